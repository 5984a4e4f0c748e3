"""Hybrid models whose layers are mostly Gated DeltaNet (linear attention, ``layers/gated_deltanet.py``) with a
full-attention layer every few (``layer_types``): Qwen3.5 (dense MLPs), Qwen3-Next (Qwen2-MoE's experts
with a shared expert, dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say) and Qwen3.5-MoE
(the same experts in every layer, the top k always renormalized).

- Attention layers: a sigmoid output gate projected with q (``AttentionSpec.output_gate``), q/k norms,
  RoPE on the first ``partial_rotary_factor`` of each head.
- Every RMSNorm but the DeltaNet's gated one is zero-centred: ``(1 + w)`` applied in float32
  (``GemmaRMSNorm``).
- Recurrent layers keep a state slot per sequence instead of KV (``LayerPlan.recurrent``).
- A checkpoint's MTP layers (``mtp.*``) are the speculative proposer's, built from ``mtp_layer_plan``
  (``models/mtp.py``).
Each follows ``transformers.models.qwen3_next`` / ``qwen3_5`` / ``qwen3_5_moe`` op for op.
"""

from __future__ import annotations

from collections.abc import Callable

from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.layers.gated_deltanet import DeltaNetSpec
from cb_serve.model_executor.layers.norm import GemmaRMSNorm
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.moe_models import qwen_experts, sparse_layer
from cb_serve.model_executor.models.plan import DenseMLP, FeedForward, LayerPlan, ModelPlan


def gated_attention(config) -> AttentionSpec:
    bias = getattr(config, "attention_bias", False)
    return AttentionSpec(None, bias, bias, qk_norm=GemmaRMSNorm, output_gate=True)


def qwen3_5_plan(config, ffn: Callable[[int], FeedForward]) -> ModelPlan:
    """Gated DeltaNet where ``layer_types`` says ``linear_attention``, gated attention elsewhere; layer ``i``'s
    feed-forward ``ffn(i)``."""
    attention = gated_attention(config)
    delta_net = DeltaNetSpec.from_config(config)
    layers = tuple(
        LayerPlan(delta_net, ffn(i), GemmaRMSNorm, mixer_prefix="linear_attn.")
        if kind == "linear_attention"
        else LayerPlan(attention, ffn(i), GemmaRMSNorm)
        for i, kind in enumerate(config.layer_types)
    )
    return ModelPlan(layers, final_norm=GemmaRMSNorm, rope_partial_default=True)


class Qwen3_5ForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        return qwen3_5_plan(config, lambda i: DenseMLP())

    @classmethod
    def mtp_layer_plan(cls, config) -> LayerPlan:
        """The checkpoint's MTP layers (``models/mtp.py``): gated full attention and the family's feed-forward."""
        return LayerPlan(gated_attention(config), DenseMLP(), GemmaRMSNorm)


class Qwen3NextForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        """Qwen2-MoE's block (experts, a gated shared expert) where the layer is sparse, else the dense MLP."""
        experts = qwen_experts(config, shared=True)
        return qwen3_5_plan(config, lambda i: experts if sparse_layer(config, i) else DenseMLP())

    @classmethod
    def mtp_layer_plan(cls, config) -> LayerPlan:
        return LayerPlan(gated_attention(config), qwen_experts(config, shared=True), GemmaRMSNorm)


class Qwen3_5MoeForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        experts = qwen_experts(config, shared=True)
        return qwen3_5_plan(config, lambda i: experts)

    @classmethod
    def mtp_layer_plan(cls, config) -> LayerPlan:
        return LayerPlan(gated_attention(config), qwen_experts(config, shared=True), GemmaRMSNorm)
