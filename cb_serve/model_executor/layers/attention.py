"""The attention layer: fused q/k/v projection, optional q/k norms, RoPE, the attention backend over the
paged KV cache, and the output projection. Each layer is configured on its own (``AttentionSpec``: its
sliding window, biases, norms, ...), as a model's layers may differ; it loads its own weights, this
rank's heads of them, from q/k/v projections or a fused ``qkv_proj`` (``load_hf_weights``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.attention.torch_backend import TorchAttentionBackend
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.model_executor.layers import fused_triton
from cb_serve.model_executor.layers.checkpoint import Rows, copy_parts, materialize
from cb_serve.model_executor.layers.full_width_norm import full_width_qk_norms
from cb_serve.model_executor.layers.kv_cache_scales import KVCacheScales
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.norm import RMSNorm
from cb_serve.model_executor.layers.rotary import Rope

REFERENCE_BACKEND = TorchAttentionBackend()  # for what a layer's backend does not support


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's features, each independent of the others: a model's attention is a choice
    of them (``models/plan.py``), and its layers may choose differently."""

    sliding_window: int | None = None  # the last ``sliding_window`` tokens only; None: every earlier token
    qkv_bias: bool = False  # biases on the q, k and v projections
    o_bias: bool = False  # a bias on the output projection
    qk_norm: type[RMSNorm] | None = None  # a norm over each q and each k head, before RoPE
    full_width_qk_norm: bool = False  # instead: one norm over all q heads' width, one over all k heads'
    v_norm: type[RMSNorm] | None = None  # a norm over each V head
    scale: float | None = None  # of the scores; None: head_dim ** -0.5
    softcap: float | None = None  # the scores capped, cap * tanh(scores / cap), before the softmax
    sinks: bool = False  # a learned logit per head in the softmax denominator (checkpoint ``self_attn.sinks``)
    rope_table: int | None = 0  # which of the model's RoPE tables turns q and k; None: no RoPE on this layer
    # Reads that earlier layer's KV cache (the layer wrote it this step), writes none, and projects q alone.
    shares_kv_of: int | None = None
    k_eq_v: bool = False  # no v projection: V is the K projection's output, before k's norm and RoPE
    clip_qkv: float | None = None  # q, k and v clamped to +-clip after the projection (and full-width norms)
    output_gate: bool = False  # a per-head gate projected with q; the output times sigmoid(gate)

    def __post_init__(self) -> None:
        assert self.sliding_window is None or self.sliding_window > 0, self.sliding_window
        assert self.scale is None or self.scale > 0, self.scale
        assert self.softcap is None or self.softcap > 0, self.softcap
        assert self.clip_qkv is None or self.clip_qkv > 0, self.clip_qkv
        assert self.rope_table is None or self.rope_table >= 0, self.rope_table
        assert self.shares_kv_of is None or self.shares_kv_of >= 0, self.shares_kv_of
        assert not (self.qk_norm and self.full_width_qk_norm), "one kind of q/k norm"

    @property
    def kv_shared(self) -> bool:
        """Reads another layer's KV cache and keeps none of its own."""
        return self.shares_kv_of is not None


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
        self.full_q_size = config.num_attention_heads * self.head_dim  # every rank's, as a checkpoint has them
        self.full_kv_size = config.num_key_value_heads * self.head_dim
        self.scale = spec.scale or self.head_dim**-0.5
        self.sliding_window = spec.sliding_window
        self.rope, self.rope_table = spec.rope_table is not None, spec.rope_table or 0
        self.backend, self.shard = backend, shard
        self.use_cpu_ops = backend.supports_fused_cpu_ops
        self.kv_shared, self.k_eq_v = spec.shares_kv_of is not None, spec.k_eq_v
        kv_projections = 0 if self.kv_shared else 1 if spec.k_eq_v else 2
        self.qkv_sizes = (self.q_size,) + (self.kv_size,) * kv_projections  # the fused projection's parts
        self.output_gate = spec.output_gate
        if spec.output_gate:
            self.qkv_sizes += (self.q_size,)  # the gate, after v
        self.qkv_proj = Linear(config.hidden_size, sum(self.qkv_sizes), bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=spec.o_bias and shard.is_driver)  # added once
        eps, own_kv = config.rms_norm_eps, not self.kv_shared
        fused = self.use_cpu_ops  # a per-head (1 + w) norm takes the C++ kernel (RMSNorm's: 2-D inputs only)
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
        self.shares_kv_of = spec.shares_kv_of
        self.kv_cache_scales: KVCacheScales | None = None  # an FP8 cache's scales from the checkpoint (not 1.0)

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
            q = self.q_norm(q) if self.q_norm is not None else q
            q = rope.apply(q) if self.rope else q
            o = self.attend(q, None, None, kv_cache, meta, extra)
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
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.rope and rope.fusable and self.backend.supports_fused_rope_kv and fused_triton.applies(qkv):
            q = self.backend.rope_and_write_kv(q, k, v, rope.cos[:, 0], rope.sin[:, 0], kv_cache, meta.slot_mapping)
            k = v = None  # in the cache already
        elif self.rope:
            q, k = rope.apply(qk).split([self.num_heads, self.num_kv_heads], dim=1)  # on q and k heads at once
        o = self.attend(q, k, v, kv_cache, meta, extra).reshape(-1, self.q_size)
        if self.output_gate:  # HF: attn_output * sigmoid(gate), in the model's dtype, before o_proj
            o = o * torch.sigmoid(qkv[:, -self.q_size :])
        return self.tp.all_reduce(self.o_proj(o))

    def attend(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata, extra: dict) -> torch.Tensor:
        """The backend's attention, with an FP8 cache's checkpoint scales folded around it (``kv_cache_scales``)."""
        scales = self.kv_cache_scales if kv_cache.dtype == torch.float8_e4m3fn else None
        backend = self.backend
        if meta.bidirectional_spans and not backend.supports_bidirectional_spans:
            backend = REFERENCE_BACKEND  # a step with image tokens attending both ways
        if scales is None:
            return backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window, **extra)
        k, v = scales.scaled_kv(k, v)
        scale = scales.softmax_scale(self.scale)
        return scales.output(backend.forward(q, k, v, kv_cache, meta, scale, self.sliding_window, **extra))

    def lora_grouped(self) -> dict[str, tuple[int, ...]]:
        """For LoRA (``lora/peft_adapter.py``, one rank): a gated q projection's rows ``[q_h | gate_h]`` per head
        land at head ``h``'s q columns and at its gate's, after v (the order ``load_hf_weights`` makes)."""
        if not self.output_gate:
            return {}
        d, gate = self.head_dim, sum(self.qkv_sizes[:-1])
        rows = [c for h in range(self.q_size // d) for start in (h * d, gate + h * d) for c in range(start, start + d)]
        return {"q_proj": tuple(rows)}

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """This rank's heads of the attention under ``prefix`` (``model.layers.{i}.self_attn.``): q, k and v
        (or the rows of a fused ``qkv_proj``) into the fused projection, with the gate of each head where
        ``output_gate``; the output projection's columns; biases, sinks and q/k norms."""
        d, shard = self.head_dim, self.shard
        q = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
        kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
        own = () if self.kv_shared else ("k",) if self.k_eq_v else ("k", "v")
        q_weight, gate = self._projection(state, prefix, "q", "weight"), ()
        if self.output_gate:  # rows [q_h | gate_h] per head
            both = materialize(q_weight).view(-1, 2, d, q_weight.shape[-1])
            q_weight, gate = both[:, 0].flatten(0, 1), (both[:, 1].flatten(0, 1)[q],)
        kv_weights = [self._projection(state, prefix, n, "weight")[kv] for n in own]
        copy_parts(self.qkv_proj.weight, q_weight[q], *kv_weights, *gate)
        copy_parts(self.o_proj.weight, state[prefix + "o_proj.weight"][:, q])
        if self.qkv_proj.bias is not None:
            assert not self.output_gate, "a gated q projection with biases"
            biases = [self._projection(state, prefix, n, "bias")[kv] for n in own]
            copy_parts(self.qkv_proj.bias, self._projection(state, prefix, "q", "bias")[q], *biases)
        if self.o_proj.bias is not None:  # the driver's alone: added once
            copy_parts(self.o_proj.bias, state[prefix + "o_proj.bias"])
        if self.sinks is not None:  # one logit per query head: this rank's heads
            copy_parts(self.sinks, state[prefix + "sinks"][shard.q_heads.start : shard.q_heads.stop])
        self.kv_cache_scales = KVCacheScales.read(state, prefix, self.shares_kv_of)
        rows = {"q_norm": q, "k_norm": kv} if self.full_width_qk_norm else {}  # full width: this rank's columns
        for name, norm in (("q_norm", self.q_norm), ("k_norm", self.k_norm), ("v_norm", self.v_norm)):
            if norm is not None and getattr(norm, "weight", None) is not None:
                copy_parts(norm.weight, state[f"{prefix}{name}.weight"][rows.get(name, slice(None))])

    def _projection(self, state: Mapping, prefix: str, name: str, kind: str):
        """Projection ``name`` (q, k or v)'s weight or bias, from its own tensor or a fused ``qkv_proj``'s rows."""
        own = f"{prefix}{name}_proj.{kind}"
        if own in state:
            return state[own]
        start = {"q": 0, "k": self.full_q_size, "v": self.full_q_size + self.full_kv_size}[name]
        size = self.full_q_size if name == "q" else self.full_kv_size
        return Rows(state[f"{prefix}qkv_proj.{kind}"], start, start + size)
