"""Gemma 3 (text): Llama's skeleton with
- Gemma's RMSNorm (``(1 + w)``, applied before the cast) everywhere, q/k norms over each head;
- four norms per layer: each sublayer's output is normed before its residual add;
- the embedding scaled by sqrt(hidden_size) (in the model's dtype), a GELU-tanh gated MLP;
- scores scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers (``layer_types``, 5 local : 1 global) with their own RoPE table (local
  ``rope_theta`` 10k against 1M and scaling for global layers).
Follows ``transformers.models.gemma3.modeling_gemma3`` op for op."""

from __future__ import annotations

import torch
from torch import nn

from cb_serve.model_executor.layers.attention import Attention, AttentionSpec, layer_windows
from cb_serve.model_executor.layers.mlp import GatedMLP
from cb_serve.model_executor.layers.norm import GemmaRMSNorm
from cb_serve.model_executor.models.llama import LlamaForCausalLM


class Gemma3DecoderLayer(nn.Module):
    """``h += post_attention_norm(attn(input_norm(h))); h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))``,
    with the model's ``(x, residual)`` convention: the hidden state is ``residual + x``."""

    def __init__(self, config, attention: Attention, mlp: GatedMLP) -> None:
        super().__init__()
        hidden, eps, fused = config.hidden_size, config.rms_norm_eps, attention.use_cpu_ops
        self.input_layernorm = GemmaRMSNorm(hidden, eps, fused)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, fused)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, fused)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, fused)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope, kv_cache, meta):
        h = x if residual is None else residual + x
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), h


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm
    # Refused, never ignored. Gemma 3's config carries attn_logit_softcapping, but HF's Gemma3Attention
    # never passes it to its attention function: applying it would differ from HF, ignoring it from the config.
    refused_features: tuple[str, ...] = ("attn_logit_softcapping", "use_bidirectional_attention")

    def __init__(self, config, *args, **kwargs) -> None:
        for feature in self.refused_features:
            if getattr(config, feature, None):
                raise ValueError(f"{type(self).__name__} with {feature}={getattr(config, feature)!r} is not supported.")
        super().__init__(config, *args, **kwargs)
        self.embed_scale = config.hidden_size**0.5

    @classmethod
    def rope_layer_types(cls, config) -> list[str]:
        return sorted(set(config.layer_types))

    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        tables = cls.rope_layer_types(config)
        bias = getattr(config, "attention_bias", False)
        scale = config.query_pre_attn_scalar**-0.5
        return [
            AttentionSpec(window, bias, bias, qk_norm=GemmaRMSNorm, scale=scale, rope_table=tables.index(kind))
            for window, kind in zip(layer_windows(config), config.layer_types)
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # HF: a float32 buffer cast to the dtype
