"""OLMo 2, over the shared layers:
- post-norms only: each sublayer's output is normed before its residual add, no pre-norm (``post``);
- q/k norms over the projections' full width (all heads together, ``FullWidthRMSNorm``) before
  RoPE: under tensor parallelism the sum of squares is all-reduced and the weights are sharded;
- RMSNorm applying its weight in float32 before the cast back (Llama casts first).
Follows ``transformers.models.olmo2.modeling_olmo2`` op for op."""

from __future__ import annotations

import torch

from cb_serve.model_executor.layers.attention import AttentionSpec, layer_windows
from cb_serve.model_executor.layers.norm import RMSNorm
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan


class Olmo2RMSNorm(RMSNorm):
    """``(w * norm(x.float())).to(dtype)``; PyTorch ops only."""

    def __init__(self, hidden_size: int, eps: float, use_cpu_ops: bool = False) -> None:
        super().__init__(hidden_size, eps, use_cpu_ops=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


class Olmo2ForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        bias = getattr(config, "attention_bias", False)
        specs = [AttentionSpec(window, bias, bias, full_width_qk_norm=True) for window in layer_windows(config)]
        layers = tuple(LayerPlan(spec, norm=Olmo2RMSNorm, placement="post") for spec in specs)
        return ModelPlan(layers, final_norm=Olmo2RMSNorm)
