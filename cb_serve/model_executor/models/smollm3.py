"""SmolLM3: Llama's layer with no RoPE on every ``no_rope_layer_interval``-th layer (``no_rope_layers``: 0 for a
NoPE layer), sliding windows only where ``use_sliding_window`` (and ``layer_types``) say, biases on all four
attention projections where ``attention_bias``. Follows ``transformers.models.smollm3.modeling_smollm3``."""

from __future__ import annotations

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan


class SmolLM3ForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        windows = layer_windows(config) if config.use_sliding_window else [None] * config.num_hidden_layers
        bias = config.attention_bias
        specs = [
            AttentionSpec(window, bias, bias, rope_table=0 if rope else None)
            for window, rope in zip(windows, config.no_rope_layers)
        ]
        return ModelPlan(tuple(LayerPlan(spec) for spec in specs))
