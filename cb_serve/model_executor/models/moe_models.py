"""Mixture-of-experts models over the shared layers: an attention of the shared kinds, and experts
(``layers/moe.py``) where a dense model has its gated MLP.

- **Mixtral**: Llama's attention (Mistral's windows); every layer sparse; softmax router, top-k renormalized.
- **Qwen3-MoE**: per-head q/k norms; softmax router renormalized by ``norm_topk_prob``; layers in
  ``mlp_only_layers`` or off every ``decoder_sparse_step``-th are dense MLPs.
- **Qwen2-MoE**: q/k/v biases; Qwen3-MoE's experts plus a shared expert gated per token.
- **OLMoE**: q/k norms over the projections' full width, ``clip_qkv``; softmax router (``norm_topk_prob``).
- **gpt-oss** (``gpt_oss.py``): its own attention and experts.
Each follows its ``transformers.models.*.modeling_*`` op for op."""

from __future__ import annotations

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.layers.mlp import activation_name
from cb_serve.model_executor.layers.moe import MoESpec
from cb_serve.model_executor.layers.moe_router import RouterSpec
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.llama import llama_attention
from cb_serve.model_executor.models.plan import DenseMLP, Experts, FeedForward, LayerPlan, ModelPlan
from cb_serve.model_executor.models.qwen2 import qwen2_attention
from cb_serve.model_executor.models.qwen3 import qwen3_attention


def num_experts(config) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def sparse_layer(config, index: int) -> bool:
    """Qwen-MoE's rule: a layer is sparse unless in ``mlp_only_layers`` or off every ``decoder_sparse_step``-th."""
    c = config
    return index not in (c.mlp_only_layers or []) and num_experts(c) > 0 and (index + 1) % c.decoder_sparse_step == 0


def qwen_experts(config, shared: bool) -> Experts:
    """Qwen-MoE's experts (``moe_intermediate_size``), with (``shared``) the shared expert gated per token."""
    renormalize = getattr(config, "norm_topk_prob", True)  # Qwen3.5-MoE: no such field, always renormalized
    router = RouterSpec(num_experts(config), config.num_experts_per_tok, renormalize=renormalize)
    moe = MoESpec(router, config.moe_intermediate_size, activation_name(config))
    return Experts(moe, config.shared_expert_intermediate_size if shared else None)


def moe_plan(specs: list[AttentionSpec], ffns: list[FeedForward]) -> ModelPlan:
    return ModelPlan(tuple(LayerPlan(spec, ffn) for spec, ffn in zip(specs, ffns)))


class MixtralForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        router = RouterSpec(num_experts(config), config.num_experts_per_tok, renormalize=True, float32_weights=True)
        experts = Experts(MoESpec(router, config.intermediate_size, config.hidden_act))
        return moe_plan(llama_attention(config), [experts] * config.num_hidden_layers)


class Qwen3MoeForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        experts = qwen_experts(config, shared=False)
        ffns = [experts if sparse_layer(config, i) else DenseMLP() for i in range(config.num_hidden_layers)]
        return moe_plan(qwen3_attention(config), ffns)


class Qwen2MoeForCausalLM(CausalLM):
    """q/k/v biases where ``qkv_bias``; Qwen3-MoE's experts plus a shared expert."""

    @classmethod
    def plan(cls, config) -> ModelPlan:
        experts = qwen_experts(config, shared=True)
        ffns = [experts if sparse_layer(config, i) else DenseMLP() for i in range(config.num_hidden_layers)]
        return moe_plan(qwen2_attention(config, getattr(config, "qkv_bias", True)), ffns)


class OlmoeForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        bias, clip = getattr(config, "attention_bias", False), getattr(config, "clip_qkv", None)
        specs = [AttentionSpec(w, bias, bias, full_width_qk_norm=True, clip_qkv=clip) for w in layer_windows(config)]
        router = RouterSpec(num_experts(config), config.num_experts_per_tok, renormalize=config.norm_topk_prob)
        experts = Experts(MoESpec(router, config.intermediate_size, config.hidden_act))
        return moe_plan(specs, [experts] * config.num_hidden_layers)
