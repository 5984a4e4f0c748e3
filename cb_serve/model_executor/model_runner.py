"""Turns a scheduled step into one ragged batch, runs the model, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from cb_serve.attention.base import AttentionMetadata
from cb_serve.errors import EngineFatalError
from cb_serve.lora.layers import LoRABatch
from cb_serve.model_executor.cuda_graph import DecodeGraphRunner
from cb_serve.model_executor.draft_verifier import verify_drafts
from cb_serve.model_executor.models.llama import LlamaForCausalLM
from cb_serve.model_executor.sampler import Sampler, SamplingBatch
from cb_serve.sequence import SchedulerOutput, Sequence
from cb_serve.structured_outputs.bitmask_filler import BitmaskFiller


class StepBroadcaster(Protocol):
    """The driver's link to its tensor-parallel workers (``cb_serve.executor.worker_pool``)."""

    pids: list[int]

    def send_step(self, batch: StepBatch) -> None: ...

    def dead_workers(self) -> list[int]: ...

    def shutdown(self) -> None: ...


INT64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices")
INT32_FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table")


@dataclass
class StepBatch:
    """One step's flattened batch on the host (no padding), as numpy arrays: what the model
    needs, and all that tensor-parallel workers receive (it pickles small)."""

    num_decodes: int
    query_lens: list[int]
    seq_lens: list[int]
    arrays: dict[str, np.ndarray]  # INT64_FIELDS and INT32_FIELDS

    @property
    def num_sampling(self) -> int:
        return len(self.arrays["logits_indices"])


@dataclass
class ModelInput:
    """One step's batch on the device: ``input_ids`` / ``positions`` are ``[T]``."""

    batch: StepBatch
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last scheduled token of each sequence that samples
    seqs: list[Sequence] = field(default_factory=list)  # in batch order: single-token (decode) rows first
    sampling_seqs: list[Sequence] = field(default_factory=list)
    rows_per_seq: list[int] = field(default_factory=list)  # logits rows of each sampling sequence: 1 + its drafts


@dataclass
class StepSample:
    """Per sampling sequence, the tokens it emits and their logprobs (None: not asked): the sampled
    token, or for a sequence that verified drafts its accepted drafts and the target's token."""

    token_ids: list[list[int]]
    logprobs: list[list[dict | None]]


class HostStaging:
    """Moves a ``StepBatch`` to the device in one copy per dtype. On CUDA the copies come from
    pinned buffers kept across steps (so they are truly asynchronous). A buffer is refilled only
    after its previous copy has run (an event recorded behind it): a step that samples nothing
    never waits on the host, so the GPU may not have reached that copy yet."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned: dict[torch.dtype, torch.Tensor] = {}
        self.copied: dict[torch.dtype, Any] = {}  # torch.cuda.Event recorded after each buffer's last copy

    def to_device(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for names, dtype in ((INT64_FIELDS, torch.int64), (INT32_FIELDS, torch.int32)):
            arrays = [np.asarray(batch.arrays[n]) for n in names]
            flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]).astype(dtype_np(dtype)))
            if self.device.type == "cuda":
                flat = self._stage(flat).to(self.device, non_blocking=True)
                self.copied.setdefault(dtype, torch.cuda.Event()).record()  # on the stream that copies
            offset = 0
            for name, a in zip(names, arrays):
                out[name] = flat[offset : offset + a.size].view(a.shape)
                offset += a.size
        return out

    def _stage(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` in this dtype's pinned buffer (grown to the next power of two when short)."""
        buf = self.pinned.get(flat.dtype)
        if buf is None or buf.numel() < flat.numel():
            # A replaced buffer is not freed under a pending copy: the pinned allocator records one.
            buf = torch.empty(max(1024, 1 << (flat.numel() - 1).bit_length()), dtype=flat.dtype).pin_memory()
            self.pinned[flat.dtype] = buf
        elif (copied := self.copied.get(flat.dtype)) is not None:
            copied.synchronize()  # the last copy out of this buffer has run
        staged = buf[: flat.numel()]
        staged.copy_(flat)
        return staged


def dtype_np(dtype: torch.dtype) -> type:
    return np.int64 if dtype == torch.int64 else np.int32


class GrammarTiming(NamedTuple):
    """One step's structured-output cost: its constrained sampling rows, the filler thread's wall
    seconds on their bitmask, and the wall seconds sampling then waited for it (what the forward
    pass did not hide)."""

    num_seqs: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0


class ModelRunner:
    """Owns the model, its KV cache and (on CUDA) the decode CUDA graphs. Under tensor parallelism
    every rank has one, holding its shard's KV heads; the driver's also has the ``workers`` it
    sends each step's batch to, and alone samples."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        cuda_graph_sizes: list[int] | None = None,
        max_model_len: int = 0,
        workers: StepBroadcaster | None = None,
    ) -> None:
        cfg = model.config
        attn = model.layers[0].self_attn
        self.model = model
        self.device = device
        self.block_size = block_size
        self.workers = workers
        self.staging = HostStaging(device)
        shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)  # this rank's KV heads
        self.kv_caches = [torch.zeros(shape, dtype=kv_cache_dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.sampler = Sampler()
        self.bitmasks = BitmaskFiller(cfg.vocab_size)
        self.last_grammar_timing = GrammarTiming()  # of the latest execute()
        self.graph_runner: DecodeGraphRunner | None = None
        self.lora_batch: LoRABatch | None = None  # set when LoRA adapters are served
        if cuda_graph_sizes:
            self.graph_runner = DecodeGraphRunner(
                self.forward, cuda_graph_sizes, max_model_len, block_size, device, capture=device.type == "cuda"
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        # Decode rows first, longest context first (attention buckets them by length).
        n_sched = sched.num_scheduled_tokens
        rows = sorted(
            range(len(sched.seqs)), key=lambda i: (n_sched[i] != 1, -(sched.seqs[i].num_computed_tokens + n_sched[i]))
        )
        seqs = [sched.seqs[i] for i in rows]
        query_lens = [sched.num_scheduled_tokens[i] for i in rows]
        starts = [s.num_computed_tokens for s in seqs]
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))

        token_ids: list[int] = []
        for seq, start, end in zip(seqs, starts, seq_lens):
            token_ids.extend(seq.token_ids[start:end])
            if end > seq.num_tokens:  # its drafts, verified in this step
                token_ids.extend(seq.spec_token_ids[: end - seq.num_tokens])
        q_lens = np.asarray(query_lens, dtype=np.int64)
        cu_q = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        cu_k = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=cu_k[1:])
        row_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(cu_q[-1]) - cu_q[:-1][row_of_token] + np.asarray(starts)[row_of_token]

        max_blocks = max(len(s.block_table) for s in seqs)
        block_table = np.zeros((len(seqs), max_blocks), dtype=np.int64)
        for i, seq in enumerate(seqs):
            block_table[i, : len(seq.block_table)] = seq.block_table
        slot_mapping = block_table[row_of_token, positions // self.block_size] * self.block_size
        slot_mapping += positions % self.block_size

        sampling = [i for i, (s, end) in enumerate(zip(seqs, seq_lens)) if end == s.num_tokens + len(s.spec_token_ids)]
        # A sampling row per sequence, its last token's; a speculating one's 1 + k last tokens.
        rows_of = [1 + len(seqs[i].spec_token_ids) for i in sampling]
        logits_indices = [cu_q[i + 1] - n + j for i, n in zip(sampling, rows_of) for j in range(n)]
        arrays = {
            "input_ids": np.asarray(token_ids, dtype=np.int64),
            "positions": positions,
            "slot_mapping": slot_mapping,
            "logits_indices": np.asarray(logits_indices, dtype=np.int64),
            "cu_seqlens_q": cu_q,
            "cu_seqlens_k": cu_k,
            "seqused_k": np.asarray(seq_lens),
            "block_table": block_table,
        }
        batch = StepBatch(num_decodes, query_lens, seq_lens, arrays)
        if self.lora_batch is not None:  # each token's adapter slot, grouped
            self.lora_batch.set_groups(np.asarray([s.lora_slot for s in seqs])[row_of_token], self.device)
        inp = self.to_device(batch, seqs, [seqs[i] for i in sampling])
        inp.rows_per_seq = rows_of
        return inp

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
            block_table=t["block_table"],
            slot_mapping=t["slot_mapping"],
        )
        ids, positions, logits_indices = t["input_ids"], t["positions"], t["logits_indices"]
        return ModelInput(batch, ids, positions, meta, logits_indices, seqs or [], sampling_seqs or [])

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> StepSample | None:
        self.last_grammar_timing = GrammarTiming()
        seqs, rows_per_seq = inp.sampling_seqs, inp.rows_per_seq
        single = [i for i, n in enumerate(rows_per_seq) if n == 1]  # sequences sampling one token
        constrained = [(row, seqs[i].matcher) for row, i in enumerate(single) if seqs[i].matcher is not None]
        masks = self.bitmasks.start(constrained)  # filled while the forward pass runs
        if self.workers is None:
            logits = self.compute_logits(inp)
        else:
            try:
                self.workers.send_step(inp.batch)
                logits = self.compute_logits(inp)
            except Exception as e:  # a rank failed mid-step: the group cannot get back in step
                raise EngineFatalError(f"a tensor-parallel step failed: {e}") from e
        if logits is None:
            return None
        starts = np.cumsum([0, *rows_per_seq]).tolist()
        out = StepSample([[] for _ in seqs], [[] for _ in seqs])
        if single:
            one_row = logits if len(single) == len(seqs) else logits[[starts[i] for i in single]]
            batch = SamplingBatch.from_seqs([seqs[i] for i in single])
            if masks is not None:
                waited = time.perf_counter()
                grammar_rows, bitmask, fill_s = masks.result()
                batch.grammar = (grammar_rows, bitmask)
                self.last_grammar_timing = GrammarTiming(len(grammar_rows), fill_s, time.perf_counter() - waited)
            sampled = self.sampler(one_row, batch)
            for row, i in enumerate(single):
                out.token_ids[i], out.logprobs[i] = [sampled.token_ids[row]], [sampled.logprobs[row]]
        for i, n in enumerate(rows_per_seq):
            if n > 1:  # drafts to verify
                out.token_ids[i], out.logprobs[i] = verify_drafts(seqs[i], logits[starts[i] : starts[i] + n])
        return out

    @torch.inference_mode()
    def compute_logits(self, inp: ModelInput) -> torch.Tensor | None:
        """The forward pass and the logits of the sampling rows (None when no row samples); what a
        tensor-parallel worker runs for each step, in step with the driver's collectives."""
        graphs = self.graph_runner
        if graphs is not None and graphs.can_run(inp.input_ids.shape[0], inp.meta):
            hidden = graphs.run(inp.input_ids, inp.positions, inp.meta)
        else:
            hidden = self.forward(inp.input_ids, inp.positions, inp.meta)
        if inp.batch.num_sampling == 0:
            return None
        return self.model.compute_logits(hidden[inp.logits_indices])

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()
