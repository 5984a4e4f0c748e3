"""Reading a mixture-of-experts block's weights, in every checkpoint layout, as one rank's slice.

- **Fused** (transformers v5's state dict): ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then
  up) and ``mlp.experts.down_proj`` ``[E, H, I]``; the router ``mlp.gate.weight``.
- **Per expert** (checkpoints on disk, GGUF, safetensors read slice by slice under tensor parallelism):
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``; Mixtral's ``block_sparse_moe.experts.{e}.w1``
  (gate), ``w3`` (up), ``w2`` (down) and ``block_sparse_moe.gate.weight``.
- **gpt-oss**: ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` with gate and up columns interleaved,
  ``down_proj`` ``[E, I, H]``, biases ``gate_up_proj_bias`` / ``down_proj_bias``, the router
  ``mlp.router.weight`` / ``bias``. Its MXFP4 checkpoints (``gate_up_proj_blocks`` / ``_scales``: rows are
  output features, 32 FP4 e2m1 codes per block, low nibble first, one e8m0 exponent per block) reach here
  dequantized by transformers, or, read lazily by a tensor-parallel rank, are dequantized here (``mxfp4``).

Each is returned in one layout: ``w13`` ``[experts, 2 * columns, H]`` and ``w2`` ``[experts, H, columns]``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from cb_serve.model_executor.layers.checkpoint import LazyTensor, materialize

State = Mapping[str, "torch.Tensor | LazyTensor"]


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., rows, 32 * groups]`` from MXFP4 ``blocks`` ``[..., rows, groups, 16]`` (two codes a byte,
    the low nibble first) and e8m0 ``scales`` ``[..., rows, groups]`` (exponent + 127). Either may arrive as
    another dtype holding the byte values (a lazy checkpoint casts what it reads)."""
    blocks, scales = blocks.to(torch.uint8), scales.to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., groups, 32]
    values = torch.ldexp(lut[codes], scales[..., None].float())
    return values.flatten(-2)


def _expert_weight(state: State, name: str, experts: slice) -> torch.Tensor:
    """gpt-oss's ``name`` (``[E, in, out]``) for ``experts``, from the tensor or from its MXFP4 blocks."""
    if name in state:
        return materialize(state[name][experts])
    blocks, scales = materialize(state[name + "_blocks"][experts]), materialize(state[name + "_scales"][experts])
    return mxfp4(blocks, scales).transpose(1, 2)


def _block(state: State, prefix: str) -> str:
    for block in ("mlp.", "block_sparse_moe."):
        if any(prefix + block + leaf in state for leaf in ("gate.weight", "router.weight")):
            return prefix + block
    raise KeyError(f"no mixture-of-experts router under {prefix!r} (mlp.gate, mlp.router or block_sparse_moe.gate)")


def _per_expert_names(state: State, block: str) -> tuple[str, str, str]:
    if block + "experts.0.w1.weight" in state:  # Mixtral's original names
        return "w1", "w3", "w2"
    return "gate_proj", "up_proj", "down_proj"


def read_router(state: State, prefix: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The router's weight ``[E, H]`` and bias (gpt-oss) or None."""
    block = _block(state, prefix)
    name = block + ("router." if block + "router.weight" in state else "gate.")
    bias = state.get(name + "bias")
    return materialize(state[name + "weight"]), None if bias is None else materialize(bias)


def read_experts(
    state: State, prefix: str, experts: range, columns: range, interleaved: bool = False, block: str | None = None
) -> dict[str, torch.Tensor]:
    """``w13``, ``w2`` and (where the checkpoint has them) ``b13``, ``b2`` of ``experts``, cut to ``columns``
    of each expert's intermediate dimension. ``interleaved``: gpt-oss's layout. ``block``: the prefix the
    ``experts.`` tensors are under, if not the router's block (Gemma 4: the layer's own)."""
    block = block if block is not None else _block(state, prefix)
    e, c = slice(experts.start, experts.stop), slice(columns.start, columns.stop)
    fused = block + "experts.gate_up_proj"
    if interleaved:
        gate_up = _expert_weight(state, fused, e)  # [E, H, 2I]: column 2i is gate i, 2i + 1 is up i
        gate, up = gate_up[..., 0::2][..., c], gate_up[..., 1::2][..., c]
        down = _expert_weight(state, block + "experts.down_proj", e)[:, c]
        out = {"w13": torch.cat([gate, up], dim=-1).transpose(1, 2), "w2": down.transpose(1, 2)}
        if fused + "_bias" in state:
            bias = materialize(state[fused + "_bias"][e])
            out["b13"] = torch.cat([bias[:, 0::2][:, c], bias[:, 1::2][:, c]], dim=-1)
            out["b2"] = materialize(state[block + "experts.down_proj_bias"][e])
        return {k: v.contiguous() for k, v in out.items()}
    if fused in state:
        size = state[fused].shape[1] // 2
        up = slice(size + columns.start, size + columns.stop)
        return {
            "w13": torch.cat([materialize(state[fused][e, c]), materialize(state[fused][e, up])], dim=1),
            "w2": materialize(state[block + "experts.down_proj"][e, :, c]),
        }
    gate, up, down = _per_expert_names(state, block)
    w13, w2 = [], []
    for i in experts:
        name = f"{block}experts.{i}."
        parts = [materialize(state[f"{name}{gate}.weight"][c]), materialize(state[f"{name}{up}.weight"][c])]
        w13.append(torch.cat(parts))
        w2.append(materialize(state[f"{name}{down}.weight"][:, c]))
    return {"w13": torch.stack(w13), "w2": torch.stack(w2)}
