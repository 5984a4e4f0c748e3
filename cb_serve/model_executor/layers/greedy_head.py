"""Greedy picks without every logit: the LM head's argmax in two passes over its 8-bit groups.

When every sampling row of a step takes the first maximum of its raw logits (``takes_raw_argmax``) and the
LM head is an 8-bit weight (Q8_0, Q5_0; enough rows), the head need not compute the whole vocabulary
float32-accurately:

1. a cheap approximation of every logit, of which only each tile's (32 columns) or tile pair's maximum is
   written, not the ``[M, vocab]`` logits:

   - ``AmxGreedyHead`` (AMX CPUs, where the head runs ``amx_gemm``): ``approx = x0 @ w~^T``, ``x0`` and
     ``w~`` the bf16 roundings of x and of the weight, every group summed on the AMX tiles
     (``amx_pair_max``);
   - ``Int8GreedyHead`` (AVX512-VNNI without AMX, where the head runs ``decode_gemm``): ``approx = x~ @
     w^T`` with ``x~ = s * xq`` per row and group of 32 inputs (``xq`` in -127..127, ``s = max|x| / 127``),
     each group's sum exact in int32, scaled by ``d * s`` in float32 (``int8_tile_max``);
2. the float32-accurate logits (the full path's kernel, so the same values bit for bit) of only the
   tiles whose maximum in some row is within ``2 B`` of that row's maximum.

``B`` bounds ``|logits_j - approx_j|`` for every column ``j`` by Cauchy-Schwarz, with ``||w_j|| <= max_j
||w_j||``: bf16 ``x·w - x0·w~ = (x - x0)·w + x0·(w - w~)``, at most ``(||x - x0|| + 2^-8 ||x0||) ||w_j||``;
int8 ``x·w - x~·w`` at most ``||x - x~|| ||w_j||`` (``w`` is exactly ``d q``), plus the float32 scaling of
its ``G`` group sums, under ``(G + 4) 2^-23 ||x~|| ||w_j||``; plus the float32 rounding of each kernel's
sums, under ``(K + 64) 2^-23 ||x|| ||w_j||``. If ``j*`` is the first maximum of the logits and ``k`` that
of ``approx``: ``approx_j* >= logits_j* - B >= logits_k - B >= approx_k - 2B``, and so for every column tied
with ``j*``: the pick among the candidates is the full path's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.low_bit_linear import EXACT_LOW_BIT, weight_rows

BF16_ROUNDING = 2.0**-8  # relative: round to nearest with 8 significant bits
NORM_SLACK = 1.0 + 2.0**-10  # float32 norms' own rounding
INT8_MIN_ROWS = 8  # below this the head streams from memory: the full path costs as much


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (``logits.max(dim=-1).indices``, like argmax and faster on CPU), in
    one read of the row in C++ for contiguous float32 logits on the CPU."""
    cpu_float32 = logits.device.type == "cpu" and logits.dtype == torch.float32
    if cpu_float32 and logits.dim() == 2 and logits.is_contiguous() and cpu_ops.available():
        return cpu_ops.argmax_rows(logits)
    return logits.max(dim=-1).indices


class GreedyHead(ABC):
    """``argmax(x @ lm_head.weight.T)[:, :vocab]`` per row of ``x`` (first maximum), bit for bit the pick
    from ``lm_head(x)``'s logits. Subclasses: the first pass and the exact logits of its candidates."""

    def __init__(self, lm_head: Linear, vocab: int) -> None:
        assert lm_head.method is EXACT_LOW_BIT and lm_head.bias is None and 0 < vocab <= lm_head.out_features
        self.lm_head, self.vocab = lm_head, vocab
        n = lm_head.out_features  # the norms of its float32 rows, from the low bits it keeps
        chunks = (weight_rows(lm_head, torch.arange(s, min(s + 16384, n))) for s in range(0, n, 16384))
        self.max_norm = float(max(torch.linalg.vector_norm(chunk, dim=1).max() for chunk in chunks)) * NORM_SLACK

    @staticmethod
    def for_head(lm_head: Linear, vocab: int) -> GreedyHead | None:
        """The greedy head this CPU runs for ``lm_head``, or None: a float or 4-bit weight, a bias, neither
        AMX (with the head on ``amx_gemm``) nor AVX512-VNNI."""
        if lm_head.method is not EXACT_LOW_BIT or lm_head.bias is not None:
            return None
        split = lm_head.split_weight
        if split is not None and split.dtype == torch.int8 and lm_head.split_kernel == "amx":
            return AmxGreedyHead(lm_head, vocab)
        packed = lm_head.decode_weight  # 8 bits with one scale per 32 inputs (not Q6_K's per 16)
        one_scale = packed.dtype == torch.int8 and packed.shape[-1] == exact_quant.Q8_GROUP_BYTES
        if one_scale and cpu_ops.int8_tile_max_available():
            return Int8GreedyHead(lm_head, vocab)
        return None

    @property
    @abstractmethod
    def min_rows(self) -> int:
        """The fewest rows this runs for (fewer: the full path)."""

    def applies(self, x: torch.Tensor) -> bool:
        """Rows enough for the two passes to beat the full path (whose picks they reproduce)."""
        return x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] >= self.min_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """int64 ``[M]`` token ids, or None when it does not apply (non-finite inputs included)."""
        if not self.applies(x) or not bool(torch.isfinite(x).all()):
            return None
        x = x.contiguous()
        maxima, bound = self.first_pass(x)
        rounding = (x.shape[1] + 64) * 2.0**-23 * 2 * torch.linalg.vector_norm(x.double(), dim=1)
        threshold = maxima.max(dim=1).values - 2 * (bound + rounding) * NORM_SLACK * self.max_norm
        units = (maxima >= threshold[:, None]).any(dim=0).nonzero()[:, 0]
        exact, columns = self.exact_logits(x, units)
        exact[:, columns >= self.vocab] = float("-inf")
        return columns[greedy_tokens(exact)]  # the sampler's own pick over the candidates

    @abstractmethod
    def first_pass(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``[M, units]`` each unit's largest approximate logit, ``[M]`` the approximation's own error over
        ``max_j ||w_j||``)."""

    @abstractmethod
    def exact_logits(self, x: torch.Tensor, units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the full path's logits of the columns of ``units``, those columns' indices)."""


class AmxGreedyHead(GreedyHead):
    """The bf16 first pass on AMX tiles, by tile pairs (64 columns); the exact logits from ``amx_gemm``."""

    @property
    def min_rows(self) -> int:
        return self.lm_head.split_min_rows  # where lm_head(x) runs amx_gemm

    def first_pass(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x0 = x.bfloat16().float()
        residual, norm_x0 = torch.linalg.vector_norm(x - x0, dim=1), torch.linalg.vector_norm(x0, dim=1)
        return cpu_ops.amx_pair_max(x, self.lm_head.split_weight, self.vocab), residual + BF16_ROUNDING * norm_x0

    def exact_logits(self, x: torch.Tensor, units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = self.lm_head.split_weight
        subset = packed.view(-1, 2, *packed.shape[1:]).index_select(0, units).view(-1, *packed.shape[1:])
        exact = cpu_ops.amx_gemm(x, subset, subset.shape[0] * 16, None)
        return exact, (units[:, None] * 32 + torch.arange(32)).flatten()


class Int8GreedyHead(GreedyHead):
    """The int8 first pass (AVX512-VNNI) over ``decode_gemm``'s 8-bit groups, by tiles (32 columns); the
    exact logits from ``decode_gemm``."""

    min_rows = INT8_MIN_ROWS

    def first_pass(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x.shape
        groups = x.view(m, k // 32, 32)
        scale = groups.abs().amax(-1) / 127  # float32, as the kernel multiplies it
        xq = torch.where(scale[..., None] > 0, groups / scale[..., None], 0).round().clamp(-127, 127)
        x_approx = scale.double()[..., None] * xq.double()  # exact: 24 by 8 significant bits
        residual = torch.linalg.vector_norm((groups.double() - x_approx).flatten(1), dim=1)
        norm_xq = torch.linalg.vector_norm(x_approx.flatten(1), dim=1)
        quads = (xq + 128).to(torch.uint8).view(torch.int32)  # [M, G, 8]: inputs 4p..4p+3 in lane p
        maxima = cpu_ops.int8_tile_max(quads, scale.contiguous(), self.lm_head.decode_weight, self.vocab)
        return maxima, residual + (k // 32 + 4) * 2.0**-23 * 2 * norm_xq

    def exact_logits(self, x: torch.Tensor, units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        subset = self.lm_head.decode_weight.index_select(0, units)
        exact = cpu_ops.decode_gemm(x, subset, subset.shape[0] * 32, None)
        return exact, (units[:, None] * 32 + torch.arange(32)).flatten()
