"""Qwen3 (dense): Llama with an RMSNorm over each q and k head before RoPE; ``attention_bias``
puts biases on all four projections, as in Llama; sliding-window layers where ``layer_types`` says."""

from __future__ import annotations

import dataclasses

from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.layers.norm import RMSNorm
from cb_serve.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        return [dataclasses.replace(spec, qk_norm=RMSNorm) for spec in super().attention_specs(config)]
