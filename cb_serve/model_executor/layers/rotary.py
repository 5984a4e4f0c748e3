"""Rotate-half rotary position embeddings over one step's flattened tokens."""

from __future__ import annotations

import torch

from cb_serve import cpu_ops


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope:
    """Rotate-half RoPE for one step's ``positions``: in place by the C++ kernel (straight from
    the float32 tables) or, in PyTorch, with the step's cos/sin rows gathered once for all layers."""

    def __init__(self, positions, cos_table, sin_table, dtype: torch.dtype, use_cpu_ops: bool) -> None:
        self.positions, self.use_cpu_ops = positions, use_cpu_ops
        if use_cpu_ops:
            self.cos, self.sin = cos_table, sin_table
        else:
            self.cos = cos_table[positions].unsqueeze(1).to(dtype)
            self.sin = sin_table[positions].unsqueeze(1).to(dtype)

    @property
    def fusable(self) -> bool:
        """The step's rows of the tables, in the model's dtype, with rotary dims to turn: what a fused RoPE
        kernel (``AttentionBackend.rope_and_write_kv``) takes as ``cos[:, 0]`` / ``sin[:, 0]``."""
        return not self.use_cpu_ops and self.cos.shape[-1] > 0

    def apply(self, qk: torch.Tensor) -> torch.Tensor:
        """``qk``: ``[T, heads, head_dim]`` (q and k heads together). Tables narrower than a head
        (partial rotary, Phi-3/4: ``partial_rotary_factor``) turn its first dims; the rest pass."""
        rotary_dim = self.cos.shape[-1]
        if rotary_dim == 0:  # no position embedding (NoPE)
            return qk
        if self.use_cpu_ops:  # the kernel works in place on a strided view of the rotary dims
            cpu_ops.rotary_embedding(qk[..., :rotary_dim], self.positions, self.cos, self.sin)
            return qk
        if rotary_dim < qk.shape[-1]:
            rot = qk[..., :rotary_dim]
            return torch.cat([rot * self.cos + rotate_half(rot) * self.sin, qk[..., rotary_dim:]], dim=-1)
        return qk * self.cos + rotate_half(qk) * self.sin


def longrope_switch(config, layer_type: str | None = None) -> int | None:
    """LongRoPE's ``original_max_position_embeddings`` (None for other RoPE types). HF picks the
    factors by sequence length, long beyond it; one table per position can only follow that for
    the newest token, so positions below it take the short factors and later ones the long."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:  # per-layer-type parameters
        params = params[layer_type]
    return params.get("original_max_position_embeddings") if params.get("rope_type") == "longrope" else None
