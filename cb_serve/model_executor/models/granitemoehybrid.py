"""IBM Granite 4 hybrids (``granitemoehybrid``): Mamba2 layers (``layers/mamba2.py``) with an attention
layer every few (``layer_types``), Granite's four multipliers (``granite.py``), and in every layer a
shared MLP plus, where ``num_local_experts`` > 0, experts routed by a softmax over the top-k logits.
Attention without position embedding (``position_embedding_type`` not ``rope``: NoPE) runs with empty
RoPE tables. Follows ``transformers.models.granitemoehybrid.modeling_granitemoehybrid`` op for op."""

from __future__ import annotations

import dataclasses

from cb_serve.model_executor.layers.mamba2 import Mamba2Spec
from cb_serve.model_executor.layers.mlp import activation_name
from cb_serve.model_executor.layers.moe import MoESpec
from cb_serve.model_executor.layers.moe_router import RouterSpec
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.granite import granite_attention, granite_plan
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan, SharedMLPAndExperts


class GraniteMoeHybridForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        c, moe = config, None
        if c.num_local_experts > 0:
            router = RouterSpec(c.num_local_experts, c.num_experts_per_tok, scoring="topk_softmax")
            moe = MoESpec(router, c.intermediate_size, activation_name(c))
        ffn, mamba = SharedMLPAndExperts(c.shared_intermediate_size, moe), Mamba2Spec.from_config(c)
        layers = [
            LayerPlan(mamba, ffn, mixer_prefix="mamba.") if kind == "linear_attention" else LayerPlan(spec, ffn)
            for kind, spec in zip(c.layer_types, granite_attention(c))
        ]
        return dataclasses.replace(granite_plan(config, layers), rope=c.position_embedding_type == "rope")
