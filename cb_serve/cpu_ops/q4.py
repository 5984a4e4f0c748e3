"""Float32 weights that are exactly 4-bit affine, kept as 4 bits for ``decode_gemm``.

A weight dequantized from GGUF Q4_1 (the built-in default model's format) is, in each group of 32
inputs of an output row, ``d * q + m`` in float32 with ``q`` in 0..15 and ``d``, ``m`` float16 scalars.
``find_q4_groups`` recovers ``(q, d, m)`` from the float32 values alone and accepts them only if they
give back every weight bit for bit, so any loading path (GGUF through transformers, a re-saved
checkpoint, row permutations such as the Q/K one) qualifies, and any other weight is left alone.
Decode then reads 0.75 bytes per weight instead of 4 and computes exactly what it computed from the
float32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # inputs per (d, m) pair, as in Q4_1
TILE_COLS = 32  # output columns per decode_gemm tile
CANDIDATE_ULPS = (0, -1, 1, -2, 2)  # float16 neighbours of the estimated scale that are tried
PROBE_ROWS = 64  # rows checked first, so that a weight of another kind is rejected cheaply


@dataclass(frozen=True)
class Q4Groups:
    q: torch.Tensor  # uint8 [N, K], 0..15
    d: torch.Tensor  # float32 [N, K // 32], float16 values, >= 0
    m: torch.Tensor  # float32 [N, K // 32], the group minimum

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.view(n, k // GROUP, GROUP).float()
        return (self.d[..., None] * q + self.m[..., None]).view(n, k)


def _find(weight: torch.Tensor) -> Q4Groups | None:
    n, k = weight.shape
    w = weight.view(n, k // GROUP, GROUP)
    m = w.amin(-1)
    span = w.amax(-1) - m  # = 15 d exactly (up to the rounding of 15 d + m)
    estimate = (span.double() / 15).half()
    if not torch.isfinite(estimate).all():
        return None
    bits = estimate.view(torch.int16)
    q = d = found = None
    for ulps in CANDIDATE_ULPS:
        candidate = (bits + ulps).clamp(min=0).view(torch.float16).float()
        safe = torch.where(candidate > 0, candidate, torch.ones_like(candidate))
        q_c = torch.round((w - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
        exact = ((candidate[..., None] * q_c + m[..., None]) == w).all(-1)
        if q is None:  # constant groups: q = 0 reproduces them whatever d is
            q, d, found = q_c, candidate, exact
        else:
            take = exact & ~found
            q = torch.where(take[..., None], q_c, q)
            d = torch.where(take, candidate, d)
            found |= exact
        if found.all():
            return Q4Groups(q.view(n, k), d, m)
    return None


def find_q4_groups(weight: torch.Tensor) -> Q4Groups | None:
    """``(q, d, m)`` with ``d * q + m == weight`` bit for bit in every group of 32 inputs, or None."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP or weight.numel() == 0:
        return None
    weight = weight.detach().contiguous()
    if _find(weight[:PROBE_ROWS]) is None:
        return None
    groups = _find(weight)
    if groups is None or not torch.equal(groups.dequantize(), weight):
        return None
    return groups


def pack_decode_weight_q4(groups: Q4Groups) -> torch.Tensor:
    """The layout ``decode_gemm`` reads (uint8 ``[tiles, K // 32, 768]``): per tile of 32 output
    columns and group of 32 inputs, ``d[32]`` and ``m[32]`` as float32, then 32 rows of 16 bytes, byte
    ``j`` holding column ``j`` in its low nibble and column ``j + 16`` in its high nibble."""
    n, k = groups.q.shape
    tiles, num_groups = -(-n // TILE_COLS), k // GROUP
    pad = tiles * TILE_COLS - n

    def per_tile(x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> zero-padded [tiles, 32 columns, ...]
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
        return x.view(tiles, TILE_COLS, *x.shape[1:])

    q = per_tile(groups.q).view(tiles, TILE_COLS, num_groups, GROUP).permute(0, 2, 3, 1)  # [t, g, k, col]
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # [t, g, 32, 16]
    scales = [per_tile(s).transpose(1, 2).contiguous().view(torch.uint8) for s in (groups.d, groups.m)]  # [t, g, 128]
    packed = torch.cat([*scales, nibbles.reshape(tiles, num_groups, GROUP * 16)], dim=-1)
    return packed.contiguous()
