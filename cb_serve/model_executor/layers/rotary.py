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

    def apply(self, qk: torch.Tensor) -> torch.Tensor:
        """``qk``: ``[T, heads, head_dim]`` (q and k heads together)."""
        if self.use_cpu_ops:
            cpu_ops.rotary_embedding(qk, self.positions, self.cos, self.sin)
            return qk
        return qk * self.cos + rotate_half(qk) * self.sin
