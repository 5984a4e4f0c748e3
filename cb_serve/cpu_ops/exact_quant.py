"""Float32 weights that are exactly low-bit, kept low-bit for ``decode_gemm``.

GGUF files store weights in groups of 32 inputs per output row; transformers dequantizes them to
float32 on load. Two formats give values that carry the group structure exactly:

- Q4_1 (the built-in default model's projections): ``d * q + m`` with ``q`` in 0..15, ``d`` and ``m``
  float16 scalars, the group minimum at ``q = 0`` and the maximum at ``q = 15``; Q4_0, ``d * (q - 8)``,
  is the same with ``m = -8 d`` (or ``-7 |d|`` for a negative ``d``, counting ``q`` down);
- Q8_0 (its embedding / LM head, and whole Q8_0 models): ``d * q`` with ``q`` in -127..127, ``d`` a
  float16 scalar, the largest magnitude at ``q = ±127``.

``find_quant_groups`` recovers ``(q, d, m)`` from the float32 values alone and accepts them only if they
give back every weight bit for bit, so any loading path qualifies (GGUF through transformers, a
re-saved checkpoint, row permutations such as Llama's Q/K one) and any other weight is left alone.
``d * q`` is exact in float32 (at most 11 + 7 significant bits), so the kernel's ``fma(d, q, m)`` is the
weight itself: decode reads 0.75 (4-bit) or 1.125 (8-bit) bytes per weight instead of 4 and computes
exactly what it computes from the float32 copy.

``pack_amx_weight`` lays the same groups out for ``amx_gemm``, which multiplies q (exact in bf16) on AMX
tiles and applies ``d`` and ``m`` per group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

GROUP = 32  # inputs per scale, as in GGUF
TILE_COLS = 32  # output columns per decode_gemm tile
CANDIDATE_ULPS = (0, -1, 1, -2, 2)  # float16 neighbours of the estimated 4-bit scale that are tried
PROBE_ROWS = 64  # rows checked first, so that a weight of another kind is rejected cheaply


@dataclass(frozen=True)
class QuantGroups:
    q: torch.Tensor  # [N, K]: uint8 0..15 (4-bit, with m) or int8 -127..127 (8-bit, m is None)
    d: torch.Tensor  # float32 [N, K // 32], float16 values
    m: torch.Tensor | None  # float32 [N, K // 32] (4-bit only)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.d[..., None] * self.q.view(n, k // GROUP, GROUP).float()
        return (w if self.m is None else w + self.m[..., None]).view(n, k)


def _q4_candidates(w: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(d, m)`` per group to try, for ``w`` ``[N, K // 32, 32]``."""
    low, high = w.amin(-1), w.amax(-1)
    # Q4_1: the group's minimum at q = 0 and maximum at q = 15, so 15 d = the range (up to rounding).
    bits = ((high - low).double() / 15).half().view(torch.int16)
    for ulps in CANDIDATE_ULPS:
        yield (bits + ulps).clamp(min=0).view(torch.float16).float(), low
    # Q4_0: d * (q - 8), the largest magnitude at q = 0, so 8 |d| = it; as d' * q' + m with d' = |d|:
    # m = -8 d' when that value is negative (d > 0), else -7 d' (d < 0, q' = 15 - q).
    d = torch.maximum(high, -low) / 8
    yield d, torch.where(-low > high, -8 * d, -7 * d)


def _find_q4(w: torch.Tensor) -> QuantGroups | None:
    """``w``: ``[N, K // 32, 32]``."""
    q = d = m = found = None
    for d_c, m_c in _q4_candidates(w):
        if not torch.isfinite(d_c).all():
            return None
        safe = torch.where(d_c > 0, d_c, torch.ones_like(d_c))
        q_c = torch.round((w - m_c[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
        exact = ((d_c[..., None] * q_c + m_c[..., None]) == w).all(-1) & (d_c == d_c.half().float())
        if q is None:  # constant groups: q = 0 reproduces them whatever d is
            q, d, m, found = q_c, d_c, m_c, exact
        else:
            take = exact & ~found
            q = torch.where(take[..., None], q_c, q)
            d, m = torch.where(take, d_c, d), torch.where(take, m_c, m)
            found |= exact
        if found.all():
            return QuantGroups(q.flatten(1), d, m)
    return None


def _find_q8(w: torch.Tensor) -> QuantGroups | None:
    d = w.abs().amax(-1) / 127  # exact: the largest magnitude is 127 d
    if not (torch.isfinite(d).all() and torch.equal(d.half().float(), d)):
        return None
    q = w / torch.where(d > 0, d, torch.ones_like(d))[..., None]
    if not torch.equal(q, q.round()):
        return None
    return QuantGroups(q.to(torch.int8).flatten(1), d, None)


def find_quant_groups(weight: torch.Tensor) -> QuantGroups | None:
    """The 4-bit or 8-bit groups that give back ``weight`` (float32 ``[N, K]``) bit for bit, or None."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP or weight.numel() == 0:
        return None
    weight = weight.detach().contiguous()
    n, k = weight.shape
    for find in (_find_q4, _find_q8):
        if find(weight[:PROBE_ROWS].view(-1, k // GROUP, GROUP)) is None:
            continue
        groups = find(weight.view(n, k // GROUP, GROUP))
        if groups is not None and torch.equal(groups.dequantize(), weight):
            return groups
    return None


def _column_tiles(x: torch.Tensor, tiles: int, cols: int) -> torch.Tensor:
    """``[N, ...]`` -> zero-padded ``[tiles, cols, ...]``."""
    pad = tiles * cols - x.shape[0]
    x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
    return x.view(tiles, cols, *x.shape[1:])


def _with_scales(groups: QuantGroups, q_rows: torch.Tensor, cols: int) -> torch.Tensor:
    """``q_rows`` (``[tiles, K // 32, R, 32]``: rows of 32 values per tile of ``cols`` output columns and
    group) -> per tile and group: ``d[cols]`` (and for 4 bits ``m[cols]``) as float32, then the R rows, 4-bit
    as 16 bytes (byte ``j``: value ``j`` in the low nibble, ``j + 16`` in the high one), 8-bit as 32."""
    tiles, num_groups = q_rows.shape[:2]
    if groups.m is None:
        rows = q_rows.reshape(tiles, num_groups, -1)
    else:
        rows = (q_rows[..., :16] | (q_rows[..., 16:] << 4)).reshape(tiles, num_groups, -1)
    scales = [groups.d] if groups.m is None else [groups.d, groups.m]
    scale_bytes = [_column_tiles(s, tiles, cols).transpose(1, 2).contiguous().view(rows.dtype) for s in scales]
    return torch.cat([*scale_bytes, rows], dim=-1).contiguous()


def pack_decode_weight_quantized(groups: QuantGroups) -> torch.Tensor:
    """The layout ``decode_gemm`` reads, per tile of 32 output columns and group of 32 inputs:
    ``d[32]`` (and for 4 bits ``m[32]``) as float32, then 32 rows (one per input) of the tile's
    columns: 4-bit as 16 bytes, byte ``j`` holding column ``j`` in its low nibble and column ``j + 16``
    in its high nibble (uint8 ``[tiles, K // 32, 768]``); 8-bit as 32 bytes (int8 ``[tiles, K // 32, 1152]``)."""
    n, k = groups.q.shape
    tiles, num_groups = -(-n // TILE_COLS), k // GROUP
    q = _column_tiles(groups.q, tiles, TILE_COLS).view(tiles, TILE_COLS, num_groups, GROUP)
    return _with_scales(groups, q.permute(0, 2, 3, 1), TILE_COLS)  # rows: [t, g, k, col]


def pack_amx_weight(groups: QuantGroups) -> torch.Tensor | None:
    """The layout ``amx_gemm`` reads, per tile of 16 output columns and group of 32 inputs: ``d[16]`` (and
    for 4 bits ``m[16]``) as float32, then q as 16 VNNI rows of 32 values (input pair, column, pair member):
    4-bit as 16 bytes, byte ``j`` holding value ``j`` in its low nibble and ``j + 16`` in its high one (uint8
    ``[N / 16, K / 32, 384]``), 8-bit as 32 int8 (``[N / 16, K / 32, 576]``). N is padded to 32; None for K
    over the kernel's 16384."""
    n, k = groups.q.shape
    if k > 16384:
        return None
    tiles, num_groups = -(-n // 32) * 2, k // GROUP
    # q [N, K] -> [tile, column, group, pair, member] -> [tile, group, pair, column, member]: 32 values a row
    q = _column_tiles(groups.q, tiles, 16).view(tiles, 16, num_groups, 16, 2).permute(0, 2, 3, 1, 4)
    return _with_scales(groups, q.reshape(tiles, num_groups, 16, 32), 16)


def _digits(n: torch.Tensor) -> list[torch.Tensor]:
    """``n = n0 * 2^16 + n1 * 2^8 + n2`` with ``n1``, ``n2`` in -128..127 (int64)."""
    out = []
    for _ in range(2):
        digit = ((n + 128) & 255) - 128
        out.append(digit)
        n = (n - digit) >> 8
    return [n, out[1], out[0]]


def split_gemm_reference(x: torch.Tensor, groups: QuantGroups, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``cpu_ops.bf16_gemm`` computes, in PyTorch: per row and group, x on a 24-bit grid below its
    largest value (``N = rint(x * 2^(23 - e))``) split into three integers exact in bf16, each piece's group
    sum against q exact, ``C = c0 2^16 + c1 2^8 + c2`` rounded to float32 once, then per group
    ``acc += d * C * 2^(e - 23)`` and for 4 bits ``acc += m * S`` (float32 operations)."""
    m, k = x.shape
    n, num_groups = groups.q.shape[0], k // GROUP
    xg = x.view(m, num_groups, GROUP)
    amax = xg.abs().amax(-1)
    finite = torch.isfinite(amax)
    e = torch.where((amax > 0) & finite, torch.frexp(amax).exponent - 1, 0)
    big_n = torch.round(torch.ldexp(xg, (23 - e)[..., None].float()))
    big_n = torch.where(finite[..., None], big_n, 0).to(torch.int64)
    unit = torch.where(finite, torch.ldexp(torch.ones(()), (e - 23).float()), float("nan"))
    sums = torch.ldexp(big_n.sum(-1).float(), (e - 23).float())
    q = groups.q.view(n, num_groups, GROUP).double()
    c0, c1, c2 = (torch.einsum("mgk,ngk->mng", p.double(), q) for p in _digits(big_n))
    v = (c0 * 65536 + c1 * 256 + c2).float() * unit[:, None, :]
    acc = torch.zeros(m, n)
    for g in range(num_groups):
        acc = acc + groups.d[None, :, g] * v[:, :, g]
        if groups.m is not None:
            acc = acc + groups.m[None, :, g] * sums[:, g, None]
    return acc + (0.0 if bias is None else bias)
