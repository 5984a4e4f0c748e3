"""IBM Granite (3.x dense): Llama's layer with four multipliers from the config:
- ``embedding_multiplier`` on the token embedding;
- ``residual_multiplier`` on each sublayer's output before its residual add;
- ``attention_multiplier`` as the score scale (in place of ``head_dim ** -0.5``);
- ``logits_scaling``: the logits divided by it.
Follows ``transformers.models.granite.modeling_granite`` op for op."""

from __future__ import annotations

import dataclasses

from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.llama import llama_attention
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan


def granite_attention(config) -> list[AttentionSpec]:
    return [dataclasses.replace(spec, scale=config.attention_multiplier) for spec in llama_attention(config)]


def granite_plan(config, layers: list[LayerPlan]) -> ModelPlan:
    """Granite's multipliers around ``layers``."""
    scaled = tuple(dataclasses.replace(layer, residual_multiplier=config.residual_multiplier) for layer in layers)
    return ModelPlan(scaled, embed_scale=config.embedding_multiplier, logits_divisor=config.logits_scaling)


class GraniteForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        return granite_plan(config, [LayerPlan(spec) for spec in granite_attention(config)])
