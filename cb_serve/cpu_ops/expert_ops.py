"""The mixture-of-experts kernels' Python side: the experts' packed weights, the grouped GEMMs over
expert-sorted rows (``decode_gemm``'s FMA tiles, and AMX tiles for experts with many rows), and the
fused combine. Loaded with the other kernels (``cpu_ops.available()``; AMX: ``amx_available()``)."""

from __future__ import annotations

import torch

from cb_serve.cpu_ops import exact_quant


def exact_in_bf16(weight: torch.Tensor) -> bool:
    """Every value of float32 ``weight`` is a bf16 value (its low 16 bits zero), as a bf16 checkpoint's are."""
    return weight.dtype == torch.float32 and not bool((weight.view(torch.int32) & 0xFFFF).any())


def fp4_expert_groups(weight: torch.Tensor) -> list[exact_quant.QuantGroups] | None:
    """Each expert's MXFP4 groups (``exact_quant.fp4_groups``) where every expert's weight is MXFP4 values
    (gpt-oss's experts, dequantized), else None (the first expert's first rows tell a weight of another kind)."""
    if weight.dim() != 3 or weight.shape[0] == 0 or exact_quant.fp4_groups(weight[0, :64]) is None:
        return None
    groups = [exact_quant.fp4_groups(w) for w in weight]
    return None if any(g is None for g in groups) else groups


def pack_expert_weight(weight: torch.Tensor, fp4: bool = True) -> torch.Tensor:
    """Float32 ``[E, N, K]`` as ``grouped_gemm`` reads it: ``pack_decode_weight`` per expert, ``[E, tiles, K,
    32]``, kept as bf16 where every weight is exact in bf16 (the same values at half the bytes); MXFP4 values
    as their FP4 codes and power-of-two scales, ``[E, tiles, K / 32, 640]`` float4_e2m1fn_x2 (0.625 bytes a
    weight, ``pack_decode_weight_quantized`` per expert; not with ``fp4`` False), the same products in registers."""
    if fp4 and (groups := fp4_expert_groups(weight)) is not None:
        packed = [exact_quant.pack_decode_weight_quantized(g).view(torch.uint8) for g in groups]
        return torch.stack(packed).view(exact_quant.FP4_DTYPE)
    packed = torch.stack([torch.ops.cb_serve.pack_decode_weight(w) for w in weight])
    return packed.to(torch.bfloat16) if exact_in_bf16(weight) else packed


def grouped_gemm(
    x: torch.Tensor,
    offsets: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    amx_min_rows: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``offsets[g]:offsets[g + 1]`` of ``x`` times group ``g``'s weight (``pack_expert_weight``). With
    ``amx_min_rows`` (a bf16 ``packed``, ``amx_available()`` only), groups of at least that many rows run on
    AMX tiles (``amx_grouped_gemm``), the others on ``decode_gemm``'s FMA tiles. ``out``: where to write."""
    out = x.new_empty(x.shape[0], out_features) if out is None else out
    max_rows = -1 if amx_min_rows is None else amx_min_rows - 1
    torch.ops.cb_serve.grouped_gemm(out, x, offsets, packed, bias, max_rows)
    if amx_min_rows is not None:
        torch.ops.cb_serve.amx_grouped_gemm(out, x, offsets, packed, bias, amx_min_rows)
    return out


def amx_grouped_gemm(
    x: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """Every group on AMX tiles (bf16 ``packed``): float32-accurate, each output a float32 sum of exact
    products (``x`` split into three bf16 pieces), not ``grouped_gemm``'s FMA chain bit for bit."""
    out = x.new_empty(x.shape[0], out_features)
    torch.ops.cb_serve.amx_grouped_gemm(out, x, offsets, packed, bias, 1)
    return out


def moe_combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: per token, ``y[rows[t, j]] * weights[t, j]`` summed from zero in ``j``'s order (-1 skipped)."""
    out = y.new_empty(rows.shape[0], y.shape[1])
    torch.ops.cb_serve.moe_combine(out, y, rows, weights)
    return out
