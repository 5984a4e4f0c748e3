"""Greedy picks without every logit: the LM head's argmax in two passes over its AMX-packed weight.

When every sampling row of a step takes the first maximum of its raw logits (``takes_raw_argmax``) and the
LM head runs ``amx_gemm`` on an 8-bit weight (Q8_0, Q5_0; enough rows), the head need not compute the whole
vocabulary float32-accurately:

1. ``approx = x0 @ w~^T``, ``x0`` and ``w~`` the bf16 roundings of x and of the weight: every group summed
   on the AMX tiles, none of the exact kernel's per-group float32 scaling, and only each 32-column tile
   pair's maximum written (``amx_pair_max``), not the ``[M, vocab]`` logits;
2. the float32-accurate logits (the full path's kernel, so the same values bit for bit) of only the
   tile pairs whose maximum in some row is within ``2 B`` of that row's maximum.

``B`` bounds ``|logits_j - approx_j|`` for every column ``j``: ``x·w - x0·w~ = (x - x0)·w + x0·(w - w~)``, so
by Cauchy-Schwarz at most ``(||x - x0|| + 2^-8 ||x0||) ||w_j||`` (bf16 keeps 8 significant bits), plus both
kernels' float32 rounding, under ``(K + 64) 2^-23 ||x|| ||w_j||`` each; ``||w_j|| <= max_j ||w_j||``. If
``j*`` is the first maximum of the logits and ``k`` that of ``approx``: ``approx_j* >= logits_j* - B >=
logits_k - B >= approx_k - 2B``, and so for every column tied with ``j*``: the pick among the candidates
is the full path's.
"""

from __future__ import annotations

import torch

from cb_serve import cpu_ops
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.low_bit_linear import weight_rows

BF16_ROUNDING = 2.0**-8  # relative: round to nearest with 8 significant bits
NORM_SLACK = 1.0 + 2.0**-10  # float32 norms' own rounding


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (``logits.max(dim=-1).indices``, like argmax and faster on CPU), in
    one read of the row in C++ for contiguous float32 logits on the CPU."""
    cpu_float32 = logits.device.type == "cpu" and logits.dtype == torch.float32
    if cpu_float32 and logits.dim() == 2 and logits.is_contiguous() and cpu_ops.available():
        return cpu_ops.argmax_rows(logits)
    return logits.max(dim=-1).indices


class GreedyHead:
    """``argmax(x @ lm_head.weight.T)[:, :vocab]`` per row of ``x`` (first maximum), bit for bit the pick
    from ``lm_head(x)``'s logits, where ``lm_head`` runs ``amx_gemm`` for those rows."""

    def __init__(self, lm_head: Linear, vocab: int) -> None:
        assert lm_head.split_kernel == "amx" and lm_head.split_weight.dtype == torch.int8 and lm_head.bias is None
        assert 0 < vocab <= lm_head.out_features
        self.lm_head, self.vocab = lm_head, vocab
        n = lm_head.out_features  # the norms of its float32 rows, from the low bits it keeps
        chunks = (weight_rows(lm_head, torch.arange(s, min(s + 16384, n))) for s in range(0, n, 16384))
        self.max_norm = float(max(torch.linalg.vector_norm(chunk, dim=1).max() for chunk in chunks)) * NORM_SLACK

    @classmethod
    def for_head(cls, lm_head: Linear, vocab: int) -> GreedyHead | None:
        """A greedy head, or None where ``lm_head`` does not run ``amx_gemm`` on an 8-bit weight (no AMX, a
        float or 4-bit weight, a bias)."""
        weight = lm_head.split_weight
        if weight is None or weight.dtype != torch.int8 or lm_head.split_kernel != "amx" or lm_head.bias is not None:
            return None
        return cls(lm_head, vocab)

    def applies(self, x: torch.Tensor) -> bool:
        """``lm_head(x)`` would run ``amx_gemm`` (the full path whose picks this reproduces)."""
        return x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] >= self.lm_head.split_min_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """int64 ``[M]`` token ids, or None when it does not apply (non-finite inputs included)."""
        if not self.applies(x) or not bool(torch.isfinite(x).all()):
            return None
        x = x.contiguous()
        head = self.lm_head
        pair_max = cpu_ops.amx_pair_max(x, head.split_weight, self.vocab)
        x0 = x.bfloat16().float()
        residual, norm_x0 = torch.linalg.vector_norm(x - x0, dim=1), torch.linalg.vector_norm(x0, dim=1)
        rounding = (x.shape[1] + 64) * 2.0**-23 * 2 * torch.linalg.vector_norm(x, dim=1)
        bound = (residual + BF16_ROUNDING * norm_x0 + rounding) * NORM_SLACK * self.max_norm
        threshold = pair_max.max(dim=1).values - 2 * bound
        pairs = (pair_max >= threshold[:, None]).any(dim=0).nonzero()[:, 0]
        packed = head.split_weight
        subset = packed.view(-1, 2, *packed.shape[1:]).index_select(0, pairs).view(-1, *packed.shape[1:])
        exact = cpu_ops.amx_gemm(x, subset, subset.shape[0] * 16, None)
        columns = (pairs[:, None] * 32 + torch.arange(32)).flatten()
        exact[:, columns >= self.vocab] = float("-inf")
        return columns[greedy_tokens(exact)]  # the sampler's own pick over the candidates
