"""Float32 weights that are exactly low-bit, kept low-bit for ``decode_gemm``.

GGUF files store weights in groups of 32 inputs per output row (or sub-blocks of 32 of super-blocks of
256); transformers dequantizes them to float32 on load. These formats give values that carry the group
structure exactly (``group_recovery`` finds them):

- 4 bits, ``d * q + m`` with ``q`` in 0..15: Q4_1 (the built-in default model's projections; float16 ``d``
  and ``m``), Q4_0 ``d * (q - 8)``, and Q4_K (``d`` and ``m`` float32 products of float16 super-block
  scales and 6-bit sub-block ones);
- 8 bits, ``d * q`` with ``q`` in -127..127 and a float16 ``d``: Q8_0 (embeddings / LM heads, whole Q8_0
  models) and Q5_0 ``d * (q - 16)`` (``q - 16`` in -16..15).

``find_quant_groups`` recovers ``(q, d, m)`` from the float32 values alone and accepts them only if they
give back every weight bit for bit, so any loading path qualifies (GGUF through transformers, a
re-saved checkpoint, row permutations such as Llama's Q/K one, fused projections whose parts differ in
format) and any other weight is left alone. ``d * q`` is exact in float32 (``d`` has at most 20
significant bits for 4-bit ``q``, 17 for 8-bit), so the kernel's ``fma(d, q, m)`` is the weight itself:
decode reads 0.75 (4-bit) or 1.125 (8-bit) bytes per weight instead of 4 and computes exactly what it
computes from the float32 copy.

``pack_amx_weight`` lays the same groups out for ``amx_gemm``, which multiplies q (exact in bf16) on AMX
tiles and applies ``d`` and ``m`` per group.

INT4 checkpoints (GPTQ, AWQ, compressed-tensors) give their groups directly (``int4_groups``): a weight is
``(q - zero) * scale`` in float32, and with a scale of at most 20 significant bits (float16, bfloat16) ``d * q``
is exact and ``m = -zero * d`` too, so ``fma(d, q, m)`` is the weight itself, as for GGUF. FP8 checkpoints give
theirs too (``Fp8Weight.low_bit_groups``): e4m3 codes as ``q`` with their blocks' float32 scales as ``d``, where
``fma(d, value, 0)`` is the product ``value * scale`` the dequantization rounds once (1.125 bytes a weight).
MXFP4 experts (gpt-oss) are found from their values (``fp4_groups``): each group of 32 inputs ``e2m1 * 2^e``,
kept as the 4-bit codes with the power of two as ``d`` (0.625 bytes a weight), where ``d * value`` is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from cb_serve.cpu_ops import group_recovery

GROUP = 32  # inputs per scale, as in GGUF
FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)  # torch 2.8 and later; before, FP4 codes are not kept
TILE_COLS = 32  # output columns per decode_gemm tile
PROBE_ROWS = 64  # rows checked first, so that a weight of another kind is rejected cheaply
FINDERS = (  # (find, inputs per group), tried in turn
    (group_recovery.find_q4, GROUP),
    (group_recovery.find_q8, GROUP),
    (group_recovery.find_q8_per_16, GROUP // 2),
)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by FP4 code


@dataclass(frozen=True)
class QuantGroups:
    # [N, K]: uint8 0..15 (4-bit: with m, integers; without, FP4 e2m1 codes), int8 -127..127 or float8_e4m3fn codes
    q: torch.Tensor
    d: torch.Tensor  # float32 [N, K // 32] (8-bit also [N, K // 16]: Q6_K's scale per 16 inputs)
    m: torch.Tensor | None  # float32 [N, K // 32] (4-bit integers only)
    # int64 [K]: the groups are of ``weight[:, perm]`` (GPTQ's activation order sorted into runs), else None
    perm: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.d.shape[1]

    @property
    def fp4(self) -> bool:
        return self.q.dtype == torch.uint8 and self.m is None

    def values(self) -> torch.Tensor:
        """float32 ``[N, K]``: each code's value before its scale."""
        return torch.tensor(E2M1_VALUES)[self.q.long()] if self.fp4 else self.q.float()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``, in its own input order."""
        n, k = self.q.shape
        w = self.d[..., None] * self.values().view(n, k // self.group_size, self.group_size)
        w = (w if self.m is None else w + self.m[..., None]).view(n, k)
        if self.perm is None:
            return w
        weight = torch.empty_like(w)
        weight[:, self.perm] = w
        return weight

    def permuted(self, perm: torch.Tensor | None) -> QuantGroups:
        """These groups as those of ``weight[:, perm]`` (their own ``q``, ``d``, ``m``)."""
        return self if perm is None else dataclasses.replace(self, perm=perm)

    @staticmethod
    def cat(parts: list[QuantGroups]) -> QuantGroups | None:
        """Groups of the weights stacked along the outputs (a fused projection's parts), or None where they
        differ in kind."""
        kinds = {(p.q.dtype, p.group_size, p.m is None, p.perm is None) for p in parts}
        if len(kinds) != 1 or len({p.q.shape[1] for p in parts}) != 1:
            return None
        perm = parts[0].perm
        if perm is not None and not all(torch.equal(p.perm, perm) for p in parts):  # one input order for all
            return None
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return QuantGroups(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m, perm)

    def scales(self) -> list[torch.Tensor]:
        """Per group of 32: ``[d]``, ``[d, m]`` (4-bit) or ``[d of the first 16 inputs, d of the last 16]``."""
        if self.group_size == GROUP // 2:
            return [self.d[:, 0::2], self.d[:, 1::2]]
        return [self.d] if self.m is None else [self.d, self.m]


def _probes(weight: torch.Tensor) -> Iterator[tuple[Callable, int]]:
    """The ``FINDERS`` whose groups give back ``weight``'s first rows, lazily in turn (cheap: a weight of
    another kind has none)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP or weight.numel() == 0:
        return
    probe, k = weight[:PROBE_ROWS].detach().contiguous(), weight.shape[1]
    for find, size in FINDERS:
        if find(probe.view(-1, k // size, size)) is not None:
            yield find, size


def may_be_quantized(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s first rows are some finder's groups (``find_quant_groups`` may then find them)."""
    return next(_probes(weight), None) is not None


def find_quant_groups(weight: torch.Tensor) -> QuantGroups | None:
    """The 4-bit or 8-bit groups that give back ``weight`` (float32 ``[N, K]``) bit for bit, or None."""
    for find, size in _probes(weight):
        n, k = weight.shape
        found = find(weight.detach().contiguous().view(n, k // size, size))
        if found is None:
            continue
        q, d, m = found
        groups = QuantGroups(q.flatten(1), d, m)
        if torch.equal(groups.dequantize(), weight):
            return groups
    return None


def fp4_groups(weight: torch.Tensor) -> QuantGroups | None:
    """The MXFP4 groups that give back ``weight`` (float32 ``[N, K]``) bit for bit, or None: per row and 32
    inputs, FP4 e2m1 codes and a power of two (the largest magnitude over it is 4 or 6, e2m1's top values: with
    the largest power of two that allows, every value of an MXFP4 block is a code's)."""
    if FP4_DTYPE is None or weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % GROUP:
        return None
    if weight.numel() == 0:
        return None
    n, k = weight.shape
    blocks = weight.detach().reshape(n, k // GROUP, GROUP)
    d = torch.ldexp(torch.ones(()), (torch.frexp(blocks.abs().amax(-1)).exponent - 3).float())  # amax / d in [4, 8)
    if not (d > 0).all():
        return None
    magnitude = blocks.abs() / d[..., None]
    positive = torch.tensor(E2M1_VALUES[:8])
    code = torch.searchsorted(positive, magnitude.contiguous()).clamp(max=7)
    if not torch.equal(positive[code], magnitude):
        return None
    q = (code | (torch.signbit(blocks).long() << 3)).to(torch.uint8).view(n, k)
    groups = QuantGroups(q, d, None)
    return groups if torch.equal(groups.dequantize(), weight) else None


def int8_groups(q: torch.Tensor, scale: torch.Tensor) -> QuantGroups | None:
    """The groups of an 8-bit weight ``q * scale`` in float32 (GPTQ's symmetric 8 bits, ``q`` less its zero point;
    compressed-tensors' INT8): ``q`` ``[N, K]`` integers, ``scale`` ``[N, K // 32]``. None where a value does not
    fit int8 or ``d * q`` would round (a scale of more than 17 significant bits)."""
    if q.shape[1] % GROUP or q.numel() == 0 or q.min() < -128 or q.max() > 127:
        return None
    d = scale.float()
    if (d.view(torch.int32) & 0x7F).any():  # 17 significant bits at most: d * q exact for |q| <= 128
        return None
    return QuantGroups(q.to(torch.int8), d, None)


def int4_groups(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> QuantGroups | None:
    """The groups of an INT4 weight ``(q - zero) * scale`` in float32 (the GPTQ, AWQ and compressed-tensors
    dequantization): ``q`` ``[N, K]`` in 0..15, ``zero`` (integers) and ``scale`` ``[N, K // 32]``, per group of
    32 inputs. None where ``fma(d, q, m)`` would not be that weight: a scale of more than 20 significant bits
    (a float32 one, say) or a zero point whose ``m`` is inexact."""
    if q.shape[1] % GROUP or q.numel() == 0 or q.min() < 0 or q.max() > 15:
        return None
    d = scale.float()
    if (d.view(torch.int32) & 0xF).any():  # more than 20 significant bits: d * q inexact
        return None
    m = -(zero.to(torch.float64) * d.double())
    if not torch.equal(m.float().double(), m):
        return None
    return QuantGroups(q.to(torch.uint8), d, m.float())


def _column_tiles(x: torch.Tensor, tiles: int, cols: int) -> torch.Tensor:
    """``[N, ...]`` -> zero-padded ``[tiles, cols, ...]``."""
    pad = tiles * cols - x.shape[0]
    x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
    return x.view(tiles, cols, *x.shape[1:])


def _with_scales(groups: QuantGroups, q_rows: torch.Tensor, cols: int) -> torch.Tensor:
    """``q_rows`` (``[tiles, K // 32, R, 32]``: rows of 32 values per tile of ``cols`` output columns and
    group) -> per tile and group: ``groups.scales()`` (``[cols]`` each) as float32, then the R rows, 4-bit
    as 16 bytes (byte ``j``: value ``j`` in the low nibble, ``j + 16`` in the high one), 8-bit as 32."""
    tiles, num_groups = q_rows.shape[:2]
    if groups.q.dtype != torch.uint8:
        rows = q_rows.reshape(tiles, num_groups, -1)
    else:  # 4-bit codes, two a byte
        rows = (q_rows[..., :16] | (q_rows[..., 16:] << 4)).reshape(tiles, num_groups, -1)
    scales = groups.scales()
    scale_bytes = [_column_tiles(s, tiles, cols).transpose(1, 2).contiguous().view(rows.dtype) for s in scales]
    return torch.cat([*scale_bytes, rows], dim=-1).contiguous()


def pack_decode_weight_quantized(groups: QuantGroups) -> torch.Tensor:
    """The layout ``decode_gemm`` reads, per tile of 32 output columns and group of 32 inputs:
    ``d[32]`` (and for 4 bits ``m[32]``, for scales per 16 inputs the second ``d[32]``) as float32, then 32 rows
    (one per input) of the tile's columns: 4-bit as 16 bytes, byte ``j`` holding column ``j`` in its low nibble
    and column ``j + 16`` in its high nibble (uint8 ``[tiles, K // 32, 768]``; FP4 codes, with no offsets, as
    float4_e2m1fn_x2 ``[tiles, K // 32, 640]``); 8-bit as 32 bytes (int8 ``[tiles, K // 32, 1152]``, or 1280 with
    scales per 16; FP8 codes as float8_e4m3fn ``[tiles, K // 32, 1152]``)."""
    n, k = groups.q.shape
    fp8 = groups.q.dtype == torch.float8_e4m3fn
    tiles, num_groups = -(-n // TILE_COLS), k // GROUP
    codes = groups.q.view(torch.uint8) if fp8 else groups.q  # (laid out as bytes)
    q = _column_tiles(codes, tiles, TILE_COLS).view(tiles, TILE_COLS, num_groups, GROUP)
    packed = _with_scales(groups, q.permute(0, 2, 3, 1), TILE_COLS)  # rows: [t, g, k, col]
    return packed.view(torch.float8_e4m3fn) if fp8 else packed.view(FP4_DTYPE) if groups.fp4 else packed


Q4_GROUP_BYTES, Q8_GROUP_BYTES, Q8X2_GROUP_BYTES, F4_GROUP_BYTES = 768, 1152, 1280, 640  # per tile and group
SCALE_COUNTS = {Q4_GROUP_BYTES: 2, Q8_GROUP_BYTES: 1, Q8X2_GROUP_BYTES: 2, F4_GROUP_BYTES: 1}  # float32 vectors first


def decode_weight_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[len(rows), K]``: the weight rows (output columns) ``rows`` of a
    ``pack_decode_weight_quantized`` layout, the values ``decode_gemm`` multiplies (``fma(d, q, m)``, with
    ``d * q`` exact: ``d * q + m`` is the same float32) and so the float32 weight the groups came from. Reads
    only those rows' bytes: an embedding lookup or a few rows' norms without a float32 copy."""
    fp4 = packed.dtype == FP4_DTYPE
    packed = packed.view(torch.uint8) if fp4 else packed
    tiles, num_groups, group_bytes = packed.shape
    scale_count = SCALE_COUNTS[group_bytes]
    tile, col = rows // TILE_COLS, rows % TILE_COLS
    scales = packed[..., : scale_count * 128].view(torch.float32).view(tiles, num_groups, scale_count, TILE_COLS)
    s = scales[tile, :, :, col]  # [R, G, scale_count]
    if packed.dtype == torch.uint8:  # 4 bits: byte j holds column j (low nibble) and j + 16 (high nibble)
        q = packed[..., scale_count * 128 :].view(tiles, num_groups, GROUP, TILE_COLS // 2)[tile, :, :, col % 16]
        q = torch.where((col < 16)[:, None, None], q & 15, q >> 4)
        if fp4:
            return (s[..., 0:1] * torch.tensor(E2M1_VALUES)[q.long()]).flatten(1)
        return torch.addcmul(s[..., 1:2], s[..., 0:1], q.float()).flatten(1)
    q = packed[..., scale_count * 128 :].view(tiles, num_groups, GROUP, TILE_COLS)[tile, :, :, col].float()
    if scale_count == 1:
        return (s * q).flatten(1)
    return torch.cat([s[..., :1] * q[..., :16], s[..., 1:] * q[..., 16:]], dim=-1).flatten(1)


def pack_amx_weight(groups: QuantGroups) -> torch.Tensor | None:
    """The layout ``amx_gemm`` reads, per tile of 16 output columns and group of 32 inputs: ``d[16]`` (and
    for 4 bits ``m[16]``) as float32, then q as 16 VNNI rows of 32 values (input pair, column, pair member):
    4-bit as 16 bytes, byte ``j`` holding value ``j`` in its low nibble and ``j + 16`` in its high one (uint8
    ``[N / 16, K / 32, 384]``), 8-bit as 32 int8 (``[N / 16, K / 32, 576]``). N is padded to 32; None for K
    over the kernel's 16384, for scales per 16 inputs and for FP8 and FP4 codes (which the kernel does not take)."""
    n, k = groups.q.shape
    if k > 16384 or groups.group_size != GROUP or groups.q.dtype == torch.float8_e4m3fn or groups.fp4:
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
