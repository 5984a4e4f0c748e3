"""Decode steps through captured CUDA graphs, one per bucketed batch size.

A decode-only step (one query token per sequence) at batch size ``n`` is padded to the smallest
captured size ``>= n``: the step's inputs are copied into static buffers and the graph that ran
the model on those buffers is replayed, so the ~10 launches per layer cost one launch. Padding
rows have ``seqused_k == 0`` and ``slot_mapping == -1``: the attention backend (one with
``supports_cuda_graphs``) writes no KV for them and returns zeros. Prefill and mixed steps, and
batches above the largest size, run eagerly.

``capture=False`` runs the same padded static-buffer path without graphs: how the padding logic
is tested on machines without CUDA.

Capture and replay run with the runner's device current (``device_context``) and capture on a
stream of that device: see ``device_context.py`` for why an engine on ``cuda:N`` needs both.
The runner holds a bound-method ``forward`` weakly: its object (the ``ModelRunner``) owns the
runner, and a strong reference back would make a cycle that only the garbage collector frees,
so ``del llm`` would leave the weights, KV cache and graphs on the device until it ran.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cb_serve.attention.base import AttentionMetadata
from cb_serve.model_executor.device_context import device_context

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def weak_callable(fn: Callable) -> Callable[[], Callable | None]:
    """A getter of ``fn`` that does not keep a bound method's object alive (None once it is
    freed); any other callable is held as is."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


def capture_sizes(max_num_seqs: int, largest: int = 256) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then multiples of 8, up to ``min(max_num_seqs, largest)``
    (``max_num_seqs`` itself included when it is not a multiple of 8)."""
    top = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def bucket_for(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding ``num_rows`` rows; None when none does (run eagerly)."""
    return next((s for s in sizes if s >= num_rows), None)


@dataclass
class DecodeBuffers:
    """Static inputs of every captured graph (each graph uses the first ``size`` rows)."""

    input_ids: torch.Tensor  # int64 [max_rows]
    positions: torch.Tensor  # int64 [max_rows]
    slot_mapping: torch.Tensor  # int64 [groups, max_rows]; -1 on padding rows
    seqused_k: torch.Tensor  # int32 [max_rows]; 0 on padding rows
    block_table: torch.Tensor  # int32 [groups, max_rows, max_blocks_per_seq]
    cu_seqlens_q: torch.Tensor  # int32 [max_rows + 1]: 0, 1, 2, ... (one query per row)
    state_slots: torch.Tensor  # int32 [max_rows]: recurrent layers' state slots; -1 on padding rows (skipped)
    layer_groups: tuple[int, ...] = ()  # each layer's KV-cache group (empty: one group)

    @classmethod
    def allocate(
        cls, max_rows: int, max_blocks_per_seq: int, device: torch.device, layer_groups: tuple[int, ...] = ()
    ) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        num_groups = max(layer_groups, default=0) + 1
        return cls(
            input_ids=zeros(max_rows),
            positions=zeros(max_rows),
            slot_mapping=torch.full((num_groups, max_rows), -1, dtype=torch.int64, device=device),
            seqused_k=zeros(max_rows, dtype=torch.int32),
            block_table=zeros(num_groups, max_rows, max_blocks_per_seq, dtype=torch.int32),
            cu_seqlens_q=torch.arange(max_rows + 1, dtype=torch.int32, device=device),
            state_slots=torch.full((max_rows,), -1, dtype=torch.int32, device=device),
            layer_groups=layer_groups,
        )

    def metadata(self, size: int, max_seqlen_k: int) -> AttentionMetadata:
        """Decode-only metadata over the first ``size`` rows. Its host lists are placeholders:
        a graph-capable backend reads only the device tensors in a decode-only step."""
        return AttentionMetadata(
            num_decodes=size,
            query_lens=[1] * size,
            seq_lens=[max_seqlen_k] * size,
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            cu_seqlens_k=self.cu_seqlens_q[: size + 1],  # unused by decode kernels
            seqused_k=self.seqused_k[:size],
            max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k,
            block_table=self.block_table[0, :size],
            slot_mapping=self.slot_mapping[0, :size],
            kv_block_tables=self.block_table[:, :size],
            kv_slot_mappings=self.slot_mapping[:, :size],
            layer_groups=self.layer_groups,
            state_slots=self.state_slots[:size],
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copies one step's ``n`` decode rows in and marks rows ``n:size`` as padding."""
        n = input_ids.shape[0]
        assert meta.max_seqlen_q == 1 and n <= size
        tables = meta.kv_block_tables if meta.kv_block_tables is not None else meta.block_table[None]
        slots = meta.kv_slot_mappings if meta.kv_slot_mappings is not None else meta.slot_mapping[None]
        width = tables.shape[-1]
        assert width <= self.block_table.shape[-1], "block table wider than max_model_len allows"
        assert tables.shape[0] == self.block_table.shape[0], "one table per KV-cache group"
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:, :n].copy_(slots, non_blocking=True)
        self.seqused_k[:n].copy_(meta.seqused_k, non_blocking=True)
        self.block_table[:, :n, :width].copy_(tables, non_blocking=True)
        if meta.state_slots is not None:  # a hybrid model's recurrent layers
            self.state_slots[:n].copy_(meta.state_slots, non_blocking=True)
            self.state_slots[n:size].fill_(-1)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[:, n:size].fill_(-1)
        self.seqused_k[n:size].zero_()


class DecodeGraphRunner:
    """Captures ``forward(input_ids, positions, meta)`` at each size: its output, a tensor or a tuple of them
    with a row per batch row (the runner's: the logits and greedy ids, ``ModelRunner.decode_graph_forward``)."""

    def __init__(
        self,
        forward: ForwardFn,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
        layer_groups: tuple[int, ...] = (),
    ) -> None:
        """``layer_groups``: each layer's KV-cache group, where the model has several."""
        self._forward = weak_callable(forward)
        self.sizes = sorted(sizes)
        self.capture = capture
        self.device = device
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], -(-max_model_len // block_size), device, layer_groups)
        self.metas = {size: self.buffers.metadata(size, max_model_len) for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        if capture:
            self._capture_all()

    def can_run(self, num_rows: int, meta: AttentionMetadata) -> bool:
        return meta.max_seqlen_q == 1 and bucket_for(num_rows, self.sizes) is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        forward = self._forward()
        if forward is None:
            raise RuntimeError("The model runner of these CUDA graphs has been freed.")
        return forward(input_ids, positions, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with device_context(self.device):
            pool = torch.cuda.graph_pool_handle()
            # One capture stream on our device for every size (sharing a pool wants the same stream);
            # torch.cuda.graph's default one is made once per process, on whichever device was current.
            stream = torch.cuda.Stream(self.device)
            b = self.buffers
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                meta = self.metas[size]
                self.forward(b.input_ids[:size], b.positions[:size], meta)  # warmup: lazy init, kernel compiles
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self.forward(b.input_ids[:size], b.positions[:size], meta)
                self.graphs[size] = graph
            torch.cuda.synchronize(self.device)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward's output for the step's rows (views into the graph's output buffers: use them
        before the next ``run``)."""
        n = input_ids.shape[0]
        size = bucket_for(n, self.sizes)
        assert size is not None and meta.max_seqlen_q == 1
        self.buffers.load(input_ids, positions, meta, size)
        if not self.capture:
            return first_rows(
                self.forward(self.buffers.input_ids[:size], self.buffers.positions[:size], self.metas[size]), n
            )
        with device_context(self.device):  # (replay also guards its capture device itself)
            self.graphs[size].replay()
        return first_rows(self.outputs[size], n)


def first_rows(output: torch.Tensor | tuple[torch.Tensor, ...], n: int):
    """The first ``n`` rows of a graph's output (a tensor or a tuple of them)."""
    return tuple(t[:n] for t in output) if isinstance(output, tuple) else output[:n]
