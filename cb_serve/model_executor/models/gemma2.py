"""Gemma 2: Gemma 3's layer (``(1 + w)`` norms, four per layer, the scaled embedding, GELU-tanh, scores
scaled by ``query_pre_attn_scalar ** -0.5``, sliding and global layers alternating by ``layer_types``)
without q/k norms, with one RoPE table for every layer, and two soft-caps: the attention scores'
(``attn_logit_softcapping``, in every attention backend) and the final logits'
(``final_logit_softcapping``). Follows ``transformers.models.gemma2.modeling_gemma2`` op for op."""

from __future__ import annotations

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.gemma3 import gemma_plan
from cb_serve.model_executor.models.plan import ModelPlan, refuse


class Gemma2ForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        refuse(cls.__name__, config, ("use_bidirectional_attention",))
        bias = getattr(config, "attention_bias", False)
        scale = config.query_pre_attn_scalar**-0.5
        softcap = config.attn_logit_softcapping or None  # HF: None turns it off
        specs = [AttentionSpec(window, bias, bias, scale=scale, softcap=softcap) for window in layer_windows(config)]
        return gemma_plan(config, specs, None)  # HF's Gemma2RotaryEmbedding: one table for every layer
