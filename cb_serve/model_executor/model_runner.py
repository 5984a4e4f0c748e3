"""Turns a scheduled step into one ragged batch, runs the model, samples."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from cb_serve.attention.base import AttentionMetadata
from cb_serve.errors import EngineFatalError
from cb_serve.kv_cache_interface import KVCacheLayout
from cb_serve.lora.manager import LoRAManager
from cb_serve.model_executor import mm_inputs, prompt_logprobs
from cb_serve.model_executor.batch_tokens import flatten_tokens, sampling_rows
from cb_serve.model_executor.block_table_rows import BlockTableRows
from cb_serve.model_executor.cache_tensors import kv_cache_tensors
from cb_serve.model_executor.cuda_graph import DecodeGraphRunner
from cb_serve.model_executor.layers.greedy_head import greedy_tokens
from cb_serve.model_executor.layers.moe import FusedMoE
from cb_serve.model_executor.models import CausalLM
from cb_serve.model_executor.sampler import Sampler, SamplingBatch, takes_raw_argmax
from cb_serve.model_executor.state_cache import StateCache
from cb_serve.model_executor.step_batch import HostStaging, ModelInput, StepBatch
from cb_serve.model_executor.step_output import (
    AsyncStepOutput,
    DraftVerifier,
    ForwardOutput,
    HostLogprobs,
    StepResult,
    copy_to_host,
)
from cb_serve.multimodal.encoder_cache import EncoderCache
from cb_serve.sequence import SchedulerOutput, Sequence
from cb_serve.stats import ExpertLoad

__all__ = ["ModelInput", "ModelRunner", "StepResult"]


class ModelRunner:
    """Owns the model, its KV cache and (on CUDA) the decode CUDA graphs; the same class on every
    tensor-parallel rank, holding its shard's KV heads (the executor hands the driver's batch to
    the other ranks, which run ``compute_logits``; the driver alone samples). Capabilities join at
    construction: ``lora`` (its slots are assigned as the batch is prepared, as vLLM's
    ``set_active_loras``) and ``draft_verifier`` (a speculating sequence's rows).

    ``record_expert_load`` (the engine's driver): in a mixture-of-experts model, each step's tokens per
    expert of every MoE layer (``FusedMoE.expert_load``, a buffer the forward updates in place, so a replayed
    CUDA graph does too), stacked and copied to the host once per step, after sampling
    (``StepResult.expert_load``); a dense model records nothing."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        cuda_graph_sizes: list[int] | None = None,
        max_model_len: int = 0,
        lora: LoRAManager | None = None,
        draft_verifier: DraftVerifier | None = None,
        kv_layout: KVCacheLayout | None = None,
        record_expert_load: bool = False,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        num_verify_states: int = 0,
        hidden_sink: Callable | None = None,
    ) -> None:
        """``kv_layout``: the KV-cache groups (default: one group of every layer); ``num_state_slots``: the
        recurrent layers' slots (``max_num_seqs``), then ``num_state_snapshots`` (``engine/state_snapshots.py``),
        ``num_verify_states`` per slot (speculative decoding's) and a scratch slot (``StateCache``); ``hidden_sink``:
        handed every forward pass's rows' hidden states (an MTP proposer's ``observe_hidden``: eager steps)."""
        cfg = model.config
        self.kv_layout = kv_layout or KVCacheLayout.from_windows([None] * cfg.num_hidden_layers)
        assert self.kv_layout.num_layers == len(model.layers)
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.lora = lora
        self.draft_verifier = draft_verifier
        self.hidden_sink = hidden_sink
        self.staging = HostStaging(device)
        width = -(-max_model_len // block_size) + 1 if max_model_len else 64
        self.block_rows = BlockTableRows(len(self.kv_layout.groups), max(64, num_state_slots), width)
        self.kv_caches: list = kv_cache_tensors(model, self.kv_layout, num_blocks, block_size, kv_cache_dtype, device)
        self.state_cache = self._state_cache(num_state_slots, num_state_snapshots, num_verify_states)
        self.sampler = Sampler()
        # Async scheduling: the last launched step's sampled ids on the device, and each sampling sequence's row
        self.prev_sampled: torch.Tensor | None = None
        self.prev_rows: dict[int | str, int] = {}
        moe = [(i, m) for i, layer in enumerate(model.layers) for m in layer.modules() if isinstance(m, FusedMoE)]
        self.moe_layers: list[FusedMoE] = [m for _, m in moe] if record_expert_load else []
        self.moe_layer_ids = tuple(i for i, _ in moe)
        assert len({m.num_experts for m in self.moe_layers}) <= 1, "MoE layers of different expert counts"
        self.graph_runner: DecodeGraphRunner | None = None
        # A model that reads images (``embed_images``): their encoder outputs by content hash
        self.encoder_cache = EncoderCache() if hasattr(model, "embed_images") else None
        if cuda_graph_sizes:
            self.graph_runner = DecodeGraphRunner(
                self.decode_graph_forward,
                cuda_graph_sizes,
                max_model_len,
                block_size,
                device,
                capture=device.type == "cuda",
                layer_groups=self.kv_layout.layer_groups,
            )

    def _state_cache(self, num_running: int, num_snapshots: int, num_verify: int) -> StateCache | None:
        """A hybrid model's recurrent states, each layer's in its place among the KV caches (None without any)."""
        specs = self.model.state_specs()
        if not specs:
            return None
        cache = StateCache(specs, num_running, self.device, num_snapshots, num_verify)
        for layer, state in cache.layers.items():
            self.kv_caches[layer] = state
        return cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, mm=None):
        """``mm``: (batch indices, image embeddings) replacing those tokens' (a model with ``embed_images``)."""
        extra = {} if mm is None else {"mm_embeds": mm}  # (a family's own forward may take none)
        return self.model(input_ids, positions, self.kv_caches, meta, **extra)

    def decode_graph_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decode step's CUDA graph runs: the forward pass, the final norm and LM head of every row, and
        each row's greedy id; after the replay only the sampler's own work is left (none for greedy rows)."""
        logits = self.model.compute_logits(self.forward(input_ids, positions, meta))
        return logits, greedy_tokens(logits)

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        # Decode rows first, longest context first (attention buckets them by length).
        n_sched = np.asarray(sched.num_scheduled_tokens, dtype=np.int64)
        computed = np.asarray([s.num_computed_tokens for s in sched.seqs], dtype=np.int64)
        rows = np.lexsort((-(computed + n_sched), n_sched != 1)).tolist()  # stable, as sorted() was
        seqs = [sched.seqs[i] for i in rows]
        query_lens = n_sched[rows].tolist()
        starts = computed[rows].tolist()
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))

        token_ids, fill_index, fill_rows = flatten_tokens(seqs, starts, seq_lens, self.prev_rows)
        q_lens = np.asarray(query_lens, dtype=np.int64)
        cu_q = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        cu_k = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=cu_k[1:])
        row_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(cu_q[-1]) - cu_q[:-1][row_of_token] + np.asarray(starts)[row_of_token]

        block_tables, slot_mappings = self._kv_arrays(seqs, row_of_token, positions)

        sampling, rows_of, logits_indices = sampling_rows(seqs, seq_lens, cu_q)
        arrays = {
            "input_ids": np.asarray(token_ids, dtype=np.int64),
            "positions": positions,
            "slot_mappings": slot_mappings,
            "logits_indices": logits_indices,
            "cu_seqlens_q": cu_q,
            "cu_seqlens_k": cu_k,
            "seqused_k": np.asarray(seq_lens),
            "block_tables": block_tables,
            "state_slots": np.asarray([s.state_slot for s in seqs], dtype=np.int32),
        }
        if fill_index:
            arrays["prev_token_index"] = np.asarray(fill_index, dtype=np.int64)
            arrays["prev_token_rows"] = np.asarray(fill_rows, dtype=np.int64)
        plan = prompt_logprobs.plan(seqs, starts, seq_lens, cu_q)
        batch = StepBatch(num_decodes, query_lens, seq_lens, arrays)
        if self.encoder_cache is not None:  # the image tokens of its prefill chunks (the slots above: by index)
            batch.mm = mm_inputs.plan_images(self.model, seqs, starts, query_lens, cu_q, positions)
        if plan is not None:
            batch.prompt_rows, batch.prompt_top_k = plan.rows, plan.top_k
        batch.state_copies = sched.state_copies
        if self.state_cache is not None:  # drafts verified on recurrent states: position by position, rolled back
            batch.verify_rows = [i for i, s in enumerate(seqs) if s.spec_token_ids and query_lens[i] > 1]
            batch.state_rollbacks = self.state_cache.rollbacks()
        if self.lora is not None:  # each token's adapter slot, grouped
            self.lora.set_active_loras([s.lora for s in seqs], row_of_token, self.device)
        inp = self.to_device(batch, seqs, [seqs[i] for i in sampling])
        inp.rows_per_seq = rows_of
        inp.prompt_plan = plan
        return inp

    def synchronize(self) -> None:
        """Waits until everything launched on the device has run."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self, seq: Sequence) -> None:
        """``seq`` gave its blocks back (finished or preempted): its block-table row is free."""
        self.block_rows.release(seq)
        if self.state_cache is not None:
            self.state_cache.release(seq.seq_id)

    def _kv_arrays(self, seqs: list[Sequence], row_of_token: np.ndarray, positions: np.ndarray):
        """Every KV-cache group's block tables ``[G, B, max_blocks]`` and each token's KV slot ``[G, T]``."""
        num_groups = len(self.kv_layout.groups)
        block_tables = self.block_rows.gather(seqs)
        slot_mappings = block_tables[:, row_of_token, positions // self.block_size] * self.block_size
        slot_mappings += positions % self.block_size
        assert num_groups == 1 or slot_mappings.min(initial=0) >= 0, "a token written to a block out of its window"
        np.maximum(block_tables, 0, out=block_tables)  # out-of-window entries (NULL_BLOCK): read, masked, never written
        return block_tables, slot_mappings

    def to_device(
        self, batch: StepBatch, seqs: list[Sequence] | None = None, sampling_seqs: list[Sequence] | None = None
    ) -> ModelInput:
        t = self.staging.to_device(batch)
        meta = AttentionMetadata(
            num_decodes=batch.num_decodes,
            query_lens=batch.query_lens,
            seq_lens=batch.seq_lens,
            cu_seqlens_q=t["cu_seqlens_q"],
            cu_seqlens_k=t["cu_seqlens_k"],
            seqused_k=t["seqused_k"],
            max_seqlen_q=max(batch.query_lens),
            max_seqlen_k=max(batch.seq_lens),
            block_table=t["block_tables"][0],
            slot_mapping=t["slot_mappings"][0],
            kv_block_tables=t["block_tables"],
            kv_slot_mappings=t["slot_mappings"],
            layer_groups=self.kv_layout.layer_groups if len(self.kv_layout.groups) > 1 else (),
            state_slots=t.get("state_slots"),
            state_slot_list=batch.arrays["state_slots"].tolist() if "state_slots" in batch.arrays else [],
            bidirectional_spans=batch.mm.spans if batch.mm is not None else {},
        )
        if self.state_cache is not None:  # rejected drafts undone, prefix hits restored, starts zeroed (HF's state)
            self.state_cache.begin_step(batch, meta)
        ids, positions, logits_indices = t["input_ids"], t["positions"], t["logits_indices"]
        if "prev_token_index" in batch.arrays:  # async scheduling: the step in flight's tokens, device to device
            assert self.prev_sampled is not None
            ids[t["prev_token_index"]] = self.prev_sampled[t["prev_token_rows"]]
        inp = ModelInput(batch, ids, positions, meta, logits_indices, seqs or [], sampling_seqs or [])
        if batch.prompt_rows is not None:
            inp.prompt_rows = torch.from_numpy(batch.prompt_rows).to(self.device)
        return inp

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, broadcast: Callable[[StepBatch], None] | None = None) -> StepResult:
        """Prepares, runs and samples one step (``broadcast``: hands the batch to the other
        tensor-parallel ranks before the forward pass). The grammar's masks
        (``sched.grammar_bitmask``, filled while the forward pass runs) apply before any pick."""
        out = self.run_and_sample(sched, broadcast)
        if self.moe_layers:  # one host copy, after sampling's
            load = torch.stack([m.expert_load for m in self.moe_layers])
            out.expert_load = ExpertLoad(self.moe_layer_ids, load.cpu().numpy())
        return out

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> AsyncStepOutput:
        """Prepares, runs and samples one step without waiting for it (async scheduling): the sampled ids
        stay on the device for the next step's inputs and start their copy to the host (their logprobs too).
        The engine launches only steps that need no host-side look at their logits: no grammar, drafts, prompt
        logprobs or bad words of several tokens (``SamplingParams.needs_host_each_step``); the penalties count
        the step in flight's tokens on the device."""
        start = time.perf_counter()
        inp = self.prepare(sched)
        prepare_s = time.perf_counter() - start
        seqs = inp.sampling_seqs
        fwd = self.run_forward(inp)
        assert fwd.prompt_hidden is None and sched.grammar_bitmask is None and len(inp.rows_per_seq) == len(seqs)
        logprobs: tuple[list[int | None], list[torch.Tensor]] | None = None
        if not fwd.samples:
            ids = torch.empty(0, dtype=torch.int64, device=self.device)
        else:
            ids = self.greedy_ids(fwd) if takes_raw_argmax(seqs) else None
            if ids is None:
                prev = None if self.prev_sampled is None else (self.prev_sampled, self.prev_rows)
                batch = SamplingBatch.from_seqs(seqs, prev, self.device)
                logits = self.logits(fwd)
                raw = torch.log_softmax(logits, dim=-1) if any(k is not None for k in batch.num_logprobs) else None
                ids = self.sampler.sample(logits, batch)
                if raw is not None:  # with every row's rank: nothing asked of the device later
                    top_vals, top_ids, chosen = Sampler.logprob_tensors(raw, batch, ids)
                    ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
                    logprobs = (batch.num_logprobs, [t for t in (top_vals, top_ids) if t is not None] + [chosen, ranks])
        self.prev_sampled, self.prev_rows = ids, {seq.seq_id: row for row, seq in enumerate(seqs)}
        host, copied = copy_to_host([ids, *(logprobs[1] if logprobs else ())])  # one event behind every copy
        out = AsyncStepOutput(seqs, host[0], copied, prepare_s)
        if logprobs is not None:
            out.logprobs = HostLogprobs(logprobs[0], host[1:])
        if self.moe_layers:
            out.expert_load = (self.moe_layer_ids, torch.stack([m.expert_load for m in self.moe_layers]))
        return out

    def run_and_sample(self, sched: SchedulerOutput, broadcast: Callable[[StepBatch], None] | None) -> StepResult:
        start = time.perf_counter()
        inp = self.prepare(sched)
        seqs, rows_per_seq = inp.sampling_seqs, inp.rows_per_seq
        out = StepResult(seqs, [[] for _ in seqs], [[] for _ in seqs], time.perf_counter() - start)
        if broadcast is None:
            fwd = self.run_forward(inp, out)
            picked = self.greedy_pick(inp, sched, fwd)
            if picked is not None:
                out.token_ids, out.logprobs = [[t] for t in picked], [[None] for _ in picked]
                return out
            logits = self.logits(fwd)
        else:
            try:
                broadcast(inp.batch)
                logits = self.compute_logits(inp, out)
            except Exception as e:  # a rank failed mid-step: the group cannot get back in step
                raise EngineFatalError(f"a tensor-parallel step failed: {e}") from e
        if logits is None:
            return out
        masks = {} if sched.grammar_bitmask is None else sched.grammar_bitmask.masks()
        starts = np.cumsum([0, *rows_per_seq]).tolist()
        single = [i for i, n in enumerate(rows_per_seq) if n == 1]  # sequences sampling one token
        if single:
            one_row = logits if len(single) == len(seqs) else logits[[starts[i] for i in single]]
            batch = SamplingBatch.from_seqs([seqs[i] for i in single], device=self.device)
            grammar_rows = [row for row, i in enumerate(single) if seqs[i].seq_id in masks]
            if grammar_rows:
                bitmask = torch.cat([masks[seqs[single[row]].seq_id] for row in grammar_rows])
                batch.grammar = (grammar_rows, bitmask)
            sampled = self.sampler(one_row, batch)
            for row, i in enumerate(single):
                out.token_ids[i], out.logprobs[i] = [sampled.token_ids[row]], [sampled.logprobs[row]]
        for i, n in enumerate(rows_per_seq):
            if n > 1:  # drafts to verify
                assert self.draft_verifier is not None, "drafts without a verifier"
                rows = logits[starts[i] : starts[i] + n]
                out.token_ids[i], out.logprobs[i] = self.draft_verifier(seqs[i], rows, masks.get(seqs[i].seq_id))
                if self.state_cache is not None:
                    self.state_cache.verified(seqs[i].seq_id, seqs[i].state_slot, n - 1, len(out.token_ids[i]) - 1)
        return out

    @torch.inference_mode()
    def compute_logits(self, inp: ModelInput, out: StepResult | None = None) -> torch.Tensor | None:
        """The forward pass, the prompt logprobs (into ``out``) and the logits of the sampling rows
        (None when no row samples); what a tensor-parallel worker runs for each step, in step with the
        driver's collectives."""
        return self.logits(self.run_forward(inp, out))

    def run_forward(self, inp: ModelInput, out: StepResult | None = None) -> ForwardOutput:
        """The forward pass, then a hybrid model's states kept at block boundaries (``StateCopies.saves``) and
        the prompt-logprob rows' logprobs (every rank computes them: the LM head's collectives; the driver's
        ``out`` gets each sequence's new entries)."""
        fwd = self._forward_rows(inp)
        if self.state_cache is not None:
            self.state_cache.end_step(inp.batch.state_copies)
        if fwd.prompt_hidden is not None:
            top_k, rows = inp.batch.prompt_top_k, inp.prompt_rows[1]
            computed = prompt_logprobs.compute(self.model.compute_logits, fwd.prompt_hidden, rows, top_k)
            if out is not None and inp.prompt_plan is not None:
                out.prompt_logprobs = prompt_logprobs.entries(inp.prompt_plan, computed)
        return fwd

    def _forward_rows(self, inp: ModelInput) -> ForwardOutput:
        """The forward pass (a decode graph's replay where one fits: its logits and greedy ids come with it),
        kept to the sampling rows and the prompt-logprob rows."""
        graphs, num_rows, sampling = self.graph_runner, inp.input_ids.shape[0], inp.batch.num_sampling
        mm = None  # image tokens: their embeddings from the encoder (or its cache), never in a decode graph
        if inp.batch.mm is not None:
            assert self.encoder_cache is not None
            mm = mm_inputs.image_embeddings(inp.batch.mm, self.encoder_cache, self.model, self.device)
        elif graphs is not None and inp.prompt_rows is None and graphs.can_run(num_rows, inp.meta):
            logits, greedy = graphs.run(inp.input_ids, inp.positions, inp.meta)
            if sampling == num_rows:  # every row samples (a decode step): its rows are the batch's, in order
                return ForwardOutput(logits=logits, greedy=greedy)
            rows = inp.logits_indices  # but a prompt's one-token chunk, which does not sample yet
            return ForwardOutput(logits=logits[rows], greedy=greedy[rows]) if sampling else ForwardOutput()
        hidden = self.forward(inp.input_ids, inp.positions, inp.meta, mm)
        if self.hidden_sink is not None:
            self.hidden_sink(inp.seqs, inp.batch.seq_lens, inp.batch.query_lens, hidden)
        prompt = None if inp.prompt_rows is None else hidden[inp.prompt_rows[0]]
        return ForwardOutput(hidden=hidden[inp.logits_indices] if sampling else None, prompt_hidden=prompt)

    def logits(self, fwd: ForwardOutput) -> torch.Tensor | None:
        """The sampling rows' logits (float32), None when no row samples."""
        if fwd.logits is not None:
            return fwd.logits
        return None if fwd.hidden is None else self.model.compute_logits(fwd.hidden)

    def greedy_ids(self, fwd: ForwardOutput) -> torch.Tensor | None:
        """Each sampling row's first maximum of its raw logits, where it comes without them (a decode graph's,
        or the model's greedy head on the CPU); else None."""
        if fwd.greedy is not None:
            return fwd.greedy
        return None if fwd.hidden is None else self.model.greedy_token_ids(fwd.hidden)

    def greedy_pick(self, inp: ModelInput, sched: SchedulerOutput, fwd: ForwardOutput) -> list[int] | None:
        """Each sampling sequence's token from ``greedy_ids`` (the same tokens as the logits' first maxima),
        where every sampling row takes its raw logits' first maximum; else None."""
        if not fwd.samples or sched.grammar_bitmask is not None or any(n != 1 for n in inp.rows_per_seq):
            return None
        if not takes_raw_argmax(inp.sampling_seqs):
            return None
        token_ids = self.greedy_ids(fwd)
        return None if token_ids is None else token_ids.tolist()
