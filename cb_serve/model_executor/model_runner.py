"""Turns a scheduled step into one ragged batch, runs the model, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from cb_serve.attention.base import AttentionMetadata
from cb_serve.model_executor.cuda_graph import DecodeGraphRunner
from cb_serve.model_executor.models.llama import LlamaForCausalLM
from cb_serve.model_executor.sampler import Sampler, SamplerOutput, SamplingBatch
from cb_serve.sequence import SchedulerOutput, Sequence
from cb_serve.structured_outputs.bitmask_filler import BitmaskFiller


@dataclass
class ModelInput:
    """One step's flattened batch (no padding): ``input_ids`` / ``positions`` are ``[T]``."""

    seqs: list[Sequence]  # in batch order: single-token (decode) rows first
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last scheduled token of each sequence that samples
    sampling_seqs: list[Sequence]


class GrammarTiming(NamedTuple):
    """One step's structured-output cost: its constrained sampling rows, the filler thread's wall
    seconds on their bitmask, and the wall seconds sampling then waited for it (what the forward
    pass did not hide)."""

    num_seqs: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0


class ModelRunner:
    """Owns the model, its KV cache and (on CUDA) the decode CUDA graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        cuda_graph_sizes: list[int] | None = None,
        max_model_len: int = 0,
    ) -> None:
        cfg = model.config
        head_dim = model.layers[0].self_attn.head_dim
        self.model = model
        self.device = device
        self.block_size = block_size
        self.pin_memory = device.type == "cuda"  # host staging buffers, so copies are truly async
        self.kv_caches = [
            torch.zeros(
                2, num_blocks, block_size, cfg.num_key_value_heads, head_dim, dtype=kv_cache_dtype, device=device
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler()
        self.bitmasks = BitmaskFiller(cfg.vocab_size)
        self.last_grammar_timing = GrammarTiming()  # of the latest execute()
        self.graph_runner: DecodeGraphRunner | None = None
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

        sampling = [i for i, (seq, end) in enumerate(zip(seqs, seq_lens)) if end == seq.num_tokens]
        dev = self.device

        def tensor(a, dtype=torch.int64) -> torch.Tensor:
            host = torch.as_tensor(np.asarray(a), dtype=dtype)
            return (host.pin_memory() if self.pin_memory else host).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_lens=query_lens,
            seq_lens=seq_lens,
            cu_seqlens_q=tensor(cu_q, torch.int32),
            cu_seqlens_k=tensor(cu_k, torch.int32),
            seqused_k=tensor(seq_lens, torch.int32),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
            block_table=tensor(block_table, torch.int32),
            slot_mapping=tensor(slot_mapping),
        )
        return ModelInput(
            seqs=seqs,
            input_ids=tensor(token_ids),
            positions=tensor(positions),
            meta=meta,
            logits_indices=tensor(cu_q[1:][sampling] - 1),
            sampling_seqs=[seqs[i] for i in sampling],
        )

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> SamplerOutput | None:
        self.last_grammar_timing = GrammarTiming()
        constrained = [(row, seq.matcher) for row, seq in enumerate(inp.sampling_seqs) if seq.matcher is not None]
        masks = self.bitmasks.start(constrained)  # filled while the forward pass runs
        graphs = self.graph_runner
        if graphs is not None and graphs.can_run(inp.input_ids.shape[0], inp.meta):
            hidden = graphs.run(inp.input_ids, inp.positions, inp.meta)
        else:
            hidden = self.forward(inp.input_ids, inp.positions, inp.meta)
        if not inp.sampling_seqs:
            return None
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        batch = SamplingBatch.from_seqs(inp.sampling_seqs)
        if masks is not None:
            waited = time.perf_counter()
            rows, bitmask, fill_s = masks.result()
            batch.grammar = (rows, bitmask)
            self.last_grammar_timing = GrammarTiming(len(rows), fill_s, time.perf_counter() - waited)
        return self.sampler(logits, batch)
