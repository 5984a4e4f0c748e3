"""Mixture-of-experts models over the shared layers: Llama-family attention, and a ``FusedMoE`` block
(``layers/moe.py``) where a dense model has its gated MLP.

- **Mixtral**: Mistral's attention; every layer sparse; softmax router, top-k renormalized.
- **Qwen3-MoE**: Qwen3's attention (per-head q/k norms); softmax router renormalized by ``norm_topk_prob``;
  layers in ``mlp_only_layers`` or off every ``decoder_sparse_step``-th are dense MLPs.
- **Qwen2-MoE**: Qwen2's attention; Qwen3-MoE's experts plus a shared expert gated per token.
- **OLMoE**: q/k norms over the projections' full width, ``clip_qkv``; softmax router (``norm_topk_prob``).
- **gpt-oss** (``gpt_oss.py``): its own attention and experts.
Each follows its ``transformers.models.*.modeling_*`` op for op."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import nn

from cb_serve.distributed.sharding import balanced_range
from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.layers.mlp import GatedMLP, activation_name
from cb_serve.model_executor.layers.moe import FusedMoE, MoESpec
from cb_serve.model_executor.layers.moe_router import RouterSpec
from cb_serve.model_executor.models.llama import LlamaForCausalLM
from cb_serve.model_executor.models.olmo2 import full_width_norm_rows
from cb_serve.model_executor.models.qwen2 import Qwen2ForCausalLM
from cb_serve.model_executor.models.qwen3 import Qwen3ForCausalLM


def num_experts(config) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, index: int) -> nn.Module:
        c = self.config
        router = RouterSpec(num_experts(c), c.num_experts_per_tok, renormalize=True, float32_weights=True)
        return FusedMoE(
            c.hidden_size, MoESpec(router, c.intermediate_size, c.hidden_act), self.shard, self.tp, self.use_cpu_ops
        )


def sparse_layer(config, index: int) -> bool:
    """Qwen-MoE's rule: a layer is sparse unless in ``mlp_only_layers`` or off every ``decoder_sparse_step``-th."""
    c = config
    return index not in (c.mlp_only_layers or []) and num_experts(c) > 0 and (index + 1) % c.decoder_sparse_step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, index: int) -> nn.Module:
        c = self.config
        if not sparse_layer(c, index):
            return super().make_mlp(index)  # a dense layer: ``intermediate_size`` columns
        router = RouterSpec(num_experts(c), c.num_experts_per_tok, renormalize=c.norm_topk_prob)
        spec = MoESpec(router, c.moe_intermediate_size, activation_name(c))
        return FusedMoE(c.hidden_size, spec, self.shard, self.tp, self.use_cpu_ops)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2's attention (q/k/v biases where ``qkv_bias``); Qwen3-MoE's experts plus a shared expert."""

    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        bias = getattr(config, "qkv_bias", True)
        return [AttentionSpec(window, qkv_bias=bias) for window in layer_windows(config)]

    def make_mlp(self, index: int) -> nn.Module:
        return self.moe_block() if sparse_layer(self.config, index) else super().make_mlp(index)

    def moe_block(self) -> FusedMoE:
        """The experts plus the shared expert gated per token (Qwen3-Next's too)."""
        c, shard = self.config, self.shard
        renormalize = getattr(c, "norm_topk_prob", True)  # Qwen3.5-MoE: no such field, always renormalized
        router = RouterSpec(num_experts(c), c.num_experts_per_tok, renormalize=renormalize)
        spec = MoESpec(router, c.moe_intermediate_size, activation_name(c))
        columns = balanced_range(c.shared_expert_intermediate_size, shard.size, shard.rank)
        shared = GatedMLP(c, dataclasses.replace(shard, intermediate=columns), self.tp, self.use_cpu_ops)
        return FusedMoE(
            c.hidden_size, spec, shard, self.tp, self.use_cpu_ops, shared_expert=shared, shared_columns=columns
        )


class OlmoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        bias, clip = getattr(config, "attention_bias", False), getattr(config, "clip_qkv", None)
        return [AttentionSpec(w, bias, bias, full_width_qk_norm=True, clip_qkv=clip) for w in layer_windows(config)]

    def make_mlp(self, index: int) -> nn.Module:
        c = self.config
        router = RouterSpec(num_experts(c), c.num_experts_per_tok, renormalize=c.norm_topk_prob)
        return FusedMoE(
            c.hidden_size, MoESpec(router, c.intermediate_size, c.hidden_act), self.shard, self.tp, self.use_cpu_ops
        )

    def load_hf_state_dict(self, state: Mapping) -> None:
        """Llama's loading, with the full-width q/k norm weights cut to this rank's heads (as OLMo 2's)."""
        super().load_hf_state_dict(full_width_norm_rows(self, state))
