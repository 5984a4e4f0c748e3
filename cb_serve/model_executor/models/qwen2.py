"""Qwen2: Llama's layer with biases on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan


def qwen2_attention(config, bias: bool = True) -> list[AttentionSpec]:
    return [AttentionSpec(window, qkv_bias=bias) for window in layer_windows(config)]


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        return ModelPlan(tuple(LayerPlan(spec) for spec in qwen2_attention(config)))
