"""Llama (and Mistral, SmolLM2): RMSNorm before each sublayer, grouped-query attention with rotate-half RoPE,
a SiLU-gated MLP; biases on all four attention projections where ``attention_bias``; a sliding window on
every layer where the config sets ``sliding_window`` (Mistral; or per ``layer_types``)."""

from __future__ import annotations

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan


def llama_attention(config) -> list[AttentionSpec]:
    """Each layer's attention: its sliding window, biases on all four projections where ``attention_bias``."""
    bias = getattr(config, "attention_bias", False)
    return [AttentionSpec(window, bias, bias) for window in layer_windows(config)]


class LlamaForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        return ModelPlan(tuple(LayerPlan(spec) for spec in llama_attention(config)))
