"""The attention layer: fused q/k/v projection, optional per-head q/k norms, RoPE, the attention
backend over the paged KV cache, and the output projection. Each layer is configured on its own
(``AttentionSpec``: its sliding window, biases, q/k norms), as a model's layers may differ."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.model_executor.layers.full_width_norm import full_width_qk_norms
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.norm import RMSNorm
from cb_serve.model_executor.layers.rotary import Rope


@dataclass(frozen=True)
class AttentionSpec:
    """What differs between architectures' (and layers') attention."""

    sliding_window: int | None = None  # None: every earlier token
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: type[RMSNorm] | None = None  # a norm over each q and k head before RoPE (Qwen3, Gemma 3)
    full_width_qk_norm: bool = False  # one norm over all q heads, one over all k heads (OLMo 2)
    scale: float | None = None  # of the scores; None: head_dim ** -0.5
    rope_table: int = 0  # which of the model's RoPE tables (Gemma 3: local and global layers differ)
    softcap: float | None = None  # scores cap * tanh(scores / cap) before the softmax (Gemma 2)
    sinks: bool = False  # a learned logit per head in the softmax denominator (gpt-oss: ``self_attn.sinks``)
    # Gemma 4: a KV-shared layer projects q alone and attends over an earlier layer's KV cache, which
    # that layer wrote this step (``LlamaForCausalLM.kv_shared_layers``); it writes none
    kv_shared: bool = False
    k_eq_v: bool = False  # no v projection: V is the K projection's output, before k's norm and RoPE
    v_norm: type[RMSNorm] | None = None  # a norm over each V head (Gemma 4's, without a weight)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip after the projection and full-width norms (OLMoE)
    output_gate: bool = False  # a per-head gate projected with q; the output times sigmoid(gate) (Qwen3.5, Qwen3-Next)

    def __post_init__(self) -> None:
        assert self.sliding_window is None or self.sliding_window > 0, self.sliding_window
        assert self.scale is None or self.scale > 0, self.scale
        assert self.softcap is None or self.softcap > 0, self.softcap
        assert self.clip_qkv is None or self.clip_qkv > 0, self.clip_qkv


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config) -> list[int | None]:
    """Per-layer sliding window (``None``: full attention), as HF's modeling code applies it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * config.num_hidden_layers


class Attention(nn.Module):
    """This rank's heads (``shard``); the output projection's partial sums are reduced over ranks."""

    def __init__(
        self,
        config,
        backend: AttentionBackend,
        spec: AttentionSpec,
        shard: TensorParallelShard,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.num_heads = len(shard.q_heads)
        self.num_kv_heads = len(shard.kv_heads)
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.scale or self.head_dim**-0.5
        self.sliding_window = spec.sliding_window
        self.rope_table = spec.rope_table
        self.backend = backend
        self.use_cpu_ops = backend.supports_fused_cpu_ops
        self.kv_shared, self.k_eq_v = spec.kv_shared, spec.k_eq_v
        kv_projections = 0 if spec.kv_shared else 1 if spec.k_eq_v else 2
        self.qkv_sizes = (self.q_size,) + (self.kv_size,) * kv_projections  # the fused projection's parts
        self.output_gate = spec.output_gate
        if spec.output_gate:
            self.qkv_sizes += (self.q_size,)  # the gate, after v
        self.qkv_proj = Linear(config.hidden_size, sum(self.qkv_sizes), bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=spec.o_bias and shard.is_driver)  # added once
        eps, own_kv = config.rms_norm_eps, not spec.kv_shared
        fused = self.use_cpu_ops  # Gemma 3's q/k norms take the C++ kernel (RMSNorm's: 2-D inputs only)
        self.q_norm = spec.qk_norm(self.head_dim, eps, fused) if spec.qk_norm else None
        self.k_norm = spec.qk_norm(self.head_dim, eps, fused) if spec.qk_norm and own_kv else None
        self.v_norm = spec.v_norm(self.head_dim, eps) if spec.v_norm and own_kv else None
        self.full_width_qk_norm = spec.full_width_qk_norm
        if spec.full_width_qk_norm:
            self.q_norm, self.k_norm = full_width_qk_norms(config, shard, tp, self.head_dim)
        self.tp = tp
        self.softcap, self.clip_qkv = spec.softcap, spec.clip_qkv
        if spec.sinks and not backend.supports_sinks:
            raise ValueError(f"The {backend.name} attention backend has no attention sinks: use triton, cpu or torch.")
        # this rank's heads' sink logits (checkpoint ``self_attn.sinks``, sliced like the heads)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if spec.sinks else None

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        extra = dict(softcap=self.softcap, sinks=self.sinks)
        if self.full_width_qk_norm:  # over the projections' whole width, before the split into heads
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        if self.kv_shared:  # q alone: the KV is the source layer's, already in the cache
            q = qkv.view(-1, self.num_heads, self.head_dim)
            q = rope.apply(self.q_norm(q) if self.q_norm is not None else q)
            o = self.backend.forward(q, None, None, kv_cache, meta, self.scale, self.sliding_window, **extra)
            return self.tp.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))
        v_start = self.q_size + (0 if self.k_eq_v else self.kv_size)
        v = qkv[:, v_start : v_start + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
        if self.k_eq_v and self.k_norm is None:  # the in-place RoPE kernel below may turn k's columns
            v = v.clone()
        if self.v_norm is not None:
            v = self.v_norm(v)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.full_width_qk_norm:  # per head: no other rank's statistics
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = rope.apply(qk)  # on q and k heads at once
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window, **extra)
        o = o.reshape(-1, self.q_size)
        if self.output_gate:  # HF: attn_output * sigmoid(gate), in the model's dtype, before o_proj
            o = o * torch.sigmoid(qkv[:, -self.q_size :])
        return self.tp.all_reduce(self.o_proj(o))
