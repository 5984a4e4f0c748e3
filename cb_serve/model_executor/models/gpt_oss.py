"""gpt-oss: attention with biases and a learned sink logit per head, sliding-window and global layers
alternating (``layer_types``), YaRN RoPE (``layers/rope_tables.py``; HF's rotary module gives half the head's
cos/sin, applied to both halves, as rotate-half's tables do); RMSNorm applying its weight in float32; and a
mixture of experts whose router takes the top k logits (with a bias) and softmaxes over them, with
biased experts and a clamped SwiGLU (``(up + 1) * gate * sigmoid(1.702 gate)``) over gate/up columns
stored interleaved. MXFP4 checkpoints are dequantized by transformers as it loads them.
Follows ``transformers.models.gpt_oss.modeling_gpt_oss`` op for op."""

from __future__ import annotations

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.layers.moe import MoESpec
from cb_serve.model_executor.layers.moe_router import RouterSpec
from cb_serve.model_executor.layers.norm import Float32WeightRMSNorm
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.moe_models import num_experts
from cb_serve.model_executor.models.plan import Experts, LayerPlan, ModelPlan


class GptOssForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        c, bias = config, getattr(config, "attention_bias", True)
        router = RouterSpec(num_experts(c), c.num_experts_per_tok, scoring="topk_softmax", bias=True)
        moe = MoESpec(
            router,
            c.intermediate_size,
            "swiglu_oai",
            expert_bias=True,
            interleaved=True,
            swiglu_alpha=getattr(c, "swiglu_alpha", 1.702),
            swiglu_limit=getattr(c, "swiglu_limit", 7.0),
        )
        layers = tuple(
            LayerPlan(AttentionSpec(window, bias, bias, sinks=True), Experts(moe), Float32WeightRMSNorm)
            for window in layer_windows(config)
        )
        return ModelPlan(layers, final_norm=Float32WeightRMSNorm)
