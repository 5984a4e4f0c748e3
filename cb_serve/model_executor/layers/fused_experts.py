"""The experts of a mixture-of-experts layer over one step's tokens, batched by expert.

HF transformers loops over the hit experts in Python, gathering each one's tokens. Here the step's
(token, expert) pairs are sorted by expert once (``route_pairs``), so each expert's tokens are one
contiguous run of rows, and a grouped GEMM (``ExpertGemm``: a backend per device) reads each active
expert's weights once for all of its rows: ``x[pairs] @ w13[e]^T`` -> activation -> ``@ w2[e]^T``.

Exactness against HF (float32): each pair's output is scaled by its routing weight in the same dtype,
and each token's outputs are summed in ascending expert order starting from zero, which is the order
HF's per-expert ``index_add_`` adds them in. Only the GEMMs' own summation order may differ.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cb_serve import cpu_ops
from cb_serve.cpu_ops import kernel_choice


@dataclass
class ExpertRouting:
    """The step's (token, expert) pairs that this rank's experts serve, sorted by expert."""

    pair_tokens: torch.Tensor  # [P] the token of each pair
    pair_weights: torch.Tensor  # [P] its routing weight
    pair_slots: torch.Tensor  # [P] its place in the [T * top_k] expert-ordered layout ``combine`` sums
    offsets: torch.Tensor  # [E_local + 1] int64: expert e's pairs are rows offsets[e]:offsets[e + 1]
    slot_rows: torch.Tensor  # [T, top_k] int64: each token's pairs' rows, experts ascending (-1: another rank's)
    slot_weights: torch.Tensor  # [T, top_k]: their routing weights
    num_tokens: int
    top_k: int


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of ``ids`` name each of ``num_experts`` experts (``bincount`` sizes its output from the data:
    a device-to-host sync, which a CUDA graph cannot capture)."""
    ids = ids.reshape(-1)
    return ids.new_zeros(num_experts).scatter_add_(0, ids, torch.ones_like(ids))


def route_pairs(weights: torch.Tensor, ids: torch.Tensor, experts: range, num_experts: int) -> ExpertRouting:
    """Pairs of the router's choice (``weights``/``ids`` ``[T, top_k]``) that go to ``experts`` (this
    rank's run of the ``num_experts``), sorted by expert (stable: tokens in order within an expert)."""
    num_tokens, top_k = ids.shape
    ids, order_in_row = ids.sort(dim=1)  # each token's experts ascending: the order its outputs are summed in
    weights = weights.gather(1, order_in_row)
    local = ids.reshape(-1) - experts.start
    outside = (local < 0) | (local >= len(experts))
    local = local.masked_fill(outside, len(experts))  # a last bucket for other ranks' experts, dropped
    slots = torch.sort(local, stable=True).indices
    counts = count_per_expert(local, len(experts) + 1)[: len(experts)]
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    if len(experts) < num_experts:  # expert parallelism: other ranks' pairs sorted last, cut off
        slots = slots[: int(offsets[-1])]
    rows = torch.full((num_tokens * top_k,), -1, dtype=torch.long, device=ids.device)
    rows[slots] = torch.arange(slots.numel(), device=ids.device)
    return ExpertRouting(
        pair_tokens=slots // top_k,
        pair_weights=weights.reshape(-1)[slots],
        pair_slots=slots,
        offsets=offsets,
        slot_rows=rows.view(num_tokens, top_k),
        slot_weights=weights,
        num_tokens=num_tokens,
        top_k=top_k,
    )


def combine(y: torch.Tensor, routing: ExpertRouting, dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]``: each token's pair outputs ``y``, times their routing weights, summed in ascending expert order."""
    y = y * routing.pair_weights[:, None]  # HF: ``out * top_k_weights[...]``, in the promoted dtype
    full = y.new_zeros(routing.num_tokens * routing.top_k, y.shape[1])
    full[routing.pair_slots] = y
    full = full.view(routing.num_tokens, routing.top_k, -1).to(dtype)
    out = torch.zeros_like(full[:, 0])
    for j in range(routing.top_k):  # HF: zeros, then index_add_ per expert in ascending order
        out += full[:, j]
    return out


class ExpertGemm(ABC):
    """``out[rows of e] = x[rows of e] @ weight[e]^T (+ bias[e])`` for every expert ``e`` at once."""

    name: str

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[E, N, K]`` in the layout this backend reads (by default unchanged)."""
        return weight

    @abstractmethod
    def __call__(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        weight: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def scratch(self, slot: int, like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """``[rows, cols]`` of ``like``'s dtype and device for an intermediate result (``slot``: which of the
        layer's live intermediates); by default freshly allocated."""
        return like.new_empty(rows, cols)

    def combine(self, y: torch.Tensor, routing: ExpertRouting, dtype: torch.dtype) -> torch.Tensor:
        """The layer's output from the pairs' outputs (``combine``; a backend may fuse it)."""
        return combine(y, routing, dtype)


class TorchExpertGemm(ExpertGemm):
    """The reference: one ``F.linear`` per expert with rows, as HF's loop runs it."""

    name = "torch"

    def __call__(self, x, offsets, weight, n, bias, out=None):
        out = x.new_empty(x.shape[0], n) if out is None else out
        bounds = offsets.tolist()
        for e in range(len(bounds) - 1):
            start, stop = bounds[e], bounds[e + 1]
            if stop > start:
                out[start:stop] = F.linear(x[start:stop], weight[e], None if bias is None else bias[e])
        return out


class CpuExpertGemm(ExpertGemm):
    """The C++ grouped GEMM (``cpu_ops.grouped_gemm``) over weights packed per expert for ``decode_gemm``'s
    tiles: one parallel loop over (expert, tile of 32 output columns), each tile streamed once for all of
    that expert's rows. Weights exact in bf16 (a bf16 checkpoint) are kept as bf16, bit for bit the same
    products at half the bytes; then, where the AMX kernel is chosen (``kernel_choice``), experts with at
    least ``AMX_MIN_ROWS`` rows (prefill) run on AMX tiles, float32-accurate."""

    name = "cpu"
    AMX_MIN_ROWS = 32  # below this decode_gemm's FMA tiles keep up (bench/moe_kernels.py)

    _scratch = threading.local()  # per engine thread: slot -> a buffer every layer's intermediates reuse

    def __init__(self) -> None:
        choice = kernel_choice.kernel_choice()
        self.amx = choice is not None and choice.split == "amx"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return cpu_ops.pack_expert_weight(weight)

    def __call__(self, x, offsets, weight, n, bias, out=None):
        amx = self.amx and weight.dtype == torch.bfloat16 and x.shape[1] % 32 == 0
        min_rows = self.AMX_MIN_ROWS if amx else None
        return cpu_ops.grouped_gemm(x.contiguous(), offsets, weight, n, bias, min_rows, out=out)

    def scratch(self, slot, like, rows, cols):
        """Kept from layer to layer and step to step: a prefill's intermediates are tens of MB, and fresh
        ones cost a page fault per 4 KB on first touch (the allocator maps them anew each time)."""
        buffers = self._scratch.__dict__.setdefault("buffers", {})
        key = (slot, torch.is_inference_mode_enabled())  # an inference tensor cannot be written outside the mode
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < rows * cols or buffer.dtype != like.dtype:
            buffer = buffers[key] = like.new_empty(max(rows * cols, 1))
        return buffer[: rows * cols].view(rows, cols)

    def combine(self, y, routing, dtype):
        """One C++ pass (``cpu_ops.moe_combine``): the same products and sums as ``combine``, in its order."""
        if y.dtype != torch.float32 or routing.slot_weights.dtype != torch.float32:
            return combine(y, routing, dtype)
        return cpu_ops.moe_combine(y, routing.slot_rows, routing.slot_weights.contiguous()).to(dtype)


def fused_experts(
    x: torch.Tensor,
    routing: ExpertRouting,
    gemm: ExpertGemm,
    w13: torch.Tensor,
    w2: torch.Tensor,
    sizes: tuple[int, int],
    activation: Callable[[torch.Tensor], torch.Tensor],
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T, H]``: this rank's experts' share of the layer's output. ``w13`` ``[E, 2I, K]`` (gate rows, then
    up) and ``w2`` ``[E, H, I]`` in ``gemm``'s layout; ``sizes``: (2I, H); ``activation``: [P, 2I] -> [P, I]."""
    pairs = routing.pair_tokens.numel()
    xs = torch.index_select(x, 0, routing.pair_tokens, out=gemm.scratch(0, x, pairs, x.shape[1]))
    h = activation(gemm(xs, routing.offsets, w13, sizes[0], b13, out=gemm.scratch(1, x, pairs, sizes[0])))
    y = gemm(h, routing.offsets, w2, sizes[1], b2, out=gemm.scratch(0, x, pairs, sizes[1]))
    return gemm.combine(y, routing, x.dtype)
