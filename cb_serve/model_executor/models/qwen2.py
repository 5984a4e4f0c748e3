"""Qwen2: Llama with biases on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        return [AttentionSpec(window, qkv_bias=True) for window in layer_windows(config)]
