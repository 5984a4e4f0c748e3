"""OLMo 2's q/k norm: one RMSNorm over the whole q (or k) projection output, every head together,
where Qwen3 and Gemma norm each head alone. Under tensor parallelism a rank holds only its heads'
columns (and their slice of the weight), so the sum of squares is all-reduced across ranks."""

from __future__ import annotations

import torch
from torch import nn

from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over ``full_size`` features of which this rank holds ``local_size`` columns
    (``[T, local_size]``), in OLMo 2's op order: float32 statistics, the weight applied in float32
    before the cast back. ``replicas``: how many ranks hold each column (a KV head replicated on
    several ranks is counted once)."""

    def __init__(self, local_size: int, full_size: int, eps: float, tp: TensorParallelGroup, replicas: int = 1) -> None:
        super().__init__()
        assert tp.size > 1 or local_size == full_size, (local_size, full_size)
        self.weight = nn.Parameter(torch.ones(local_size))
        self.full_size, self.eps, self.tp, self.replicas = full_size, eps, tp, replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        if self.tp.size == 1:  # HF's own op: a mean over the full width
            variance = y.pow(2).mean(-1, keepdim=True)
        else:  # every rank's partial sum of squares, each column once
            variance = self.tp.all_reduce(y.pow(2).sum(-1, keepdim=True)) / (self.full_size * self.replicas)
        y = y * torch.rsqrt(variance + self.eps)
        return (self.weight * y).to(dtype)


def full_width_qk_norms(
    config, shard: TensorParallelShard, tp: TensorParallelGroup, head_dim: int
) -> tuple[FullWidthRMSNorm, FullWidthRMSNorm]:
    """This rank's q and k norms of ``config`` (HF: ``q_norm``/``k_norm`` over all heads' width)."""
    eps, heads, kv_heads = config.rms_norm_eps, config.num_attention_heads, config.num_key_value_heads
    q_norm = FullWidthRMSNorm(len(shard.q_heads) * head_dim, heads * head_dim, eps, tp)
    replicas = max(1, shard.size // kv_heads)  # more ranks than KV heads: each KV head on several
    k_norm = FullWidthRMSNorm(len(shard.kv_heads) * head_dim, kv_heads * head_dim, eps, tp, replicas)
    return q_norm, k_norm
