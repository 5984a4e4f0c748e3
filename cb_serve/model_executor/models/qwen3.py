"""Qwen3 (dense): Llama's layer with an RMSNorm over each q and k head before RoPE; ``attention_bias`` puts
biases on all four projections; sliding-window layers where ``layer_types`` says."""

from __future__ import annotations

import dataclasses

from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.layers.norm import RMSNorm
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.llama import llama_attention
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan


def qwen3_attention(config) -> list[AttentionSpec]:
    return [dataclasses.replace(spec, qk_norm=RMSNorm) for spec in llama_attention(config)]


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        return ModelPlan(tuple(LayerPlan(spec) for spec in qwen3_attention(config)))
