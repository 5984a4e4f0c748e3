"""Gemma 3 (text), over the shared layers:
- Gemma's RMSNorm (``(1 + w)``, applied before the cast) everywhere, q/k norms over each head;
- four norms per layer: each sublayer's output is normed before its residual add (``sandwich``);
- the embedding scaled by sqrt(hidden_size) (in the model's dtype), a GELU-tanh gated MLP;
- scores scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers (``layer_types``, 5 local : 1 global) with their own RoPE table (local
  ``rope_theta`` 10k against 1M and scaling for global layers).
Follows ``transformers.models.gemma3.modeling_gemma3`` op for op."""

from __future__ import annotations

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.layers.norm import GemmaRMSNorm
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan, refuse


def gemma_plan(config, specs: list[AttentionSpec], rope_layer_types: tuple[str, ...] | None) -> ModelPlan:
    """Gemma 2's and 3's stack around ``specs``: ``(1 + w)`` norms around each sublayer, the scaled
    embedding, the final logits soft-capped where ``final_logit_softcapping``."""
    layers = tuple(LayerPlan(spec, norm=GemmaRMSNorm, placement="sandwich") for spec in specs)
    softcap = getattr(config, "final_logit_softcapping", None) or None
    scale = config.hidden_size**0.5  # HF: a float32 buffer cast to the model's dtype
    return ModelPlan(layers, GemmaRMSNorm, scale, True, logits_softcap=softcap, rope_layer_types=rope_layer_types)


class Gemma3ForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        # Gemma 3's config carries attn_logit_softcapping, but HF's Gemma3Attention never passes it to its
        # attention function: applying it would differ from HF, ignoring it from the config.
        refuse(cls.__name__, config, ("attn_logit_softcapping", "use_bidirectional_attention"))
        tables = tuple(sorted(set(config.layer_types)))
        bias = getattr(config, "attention_bias", False)
        scale = config.query_pre_attn_scalar**-0.5
        specs = [
            AttentionSpec(window, bias, bias, qk_norm=GemmaRMSNorm, scale=scale, rope_table=tables.index(kind))
            for window, kind in zip(layer_windows(config), config.layer_types)
        ]
        return gemma_plan(config, specs, tables)
