"""OLMo 2: Llama's skeleton with
- post-norms only: each sublayer's output is normed before its residual add, no pre-norm;
- q/k norms over the projections' full width (all heads together, ``FullWidthRMSNorm``) before
  RoPE: under tensor parallelism the sum of squares is all-reduced and the weights are sharded;
- RMSNorm applying its weight in float32 before the cast back (Llama casts first).
Follows ``transformers.models.olmo2.modeling_olmo2`` op for op."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.model_executor.layers.attention import Attention, AttentionSpec, layer_windows
from cb_serve.model_executor.layers.checkpoint import LazyTensor
from cb_serve.model_executor.layers.mlp import GatedMLP
from cb_serve.model_executor.layers.norm import RMSNorm
from cb_serve.model_executor.models.llama import LlamaForCausalLM
from cb_serve.model_executor.models.state_views import Rows, StateView


class Olmo2RMSNorm(RMSNorm):
    """``(w * norm(x.float())).to(dtype)``; PyTorch ops only."""

    def __init__(self, hidden_size: int, eps: float, use_cpu_ops: bool = False) -> None:
        super().__init__(hidden_size, eps, use_cpu_ops=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


class Olmo2DecoderLayer(nn.Module):
    """``h += post_attention_norm(attn(h)); h += post_feedforward_norm(mlp(h))``, with the model's
    ``(x, residual)`` convention: the hidden state is ``residual + x``."""

    def __init__(self, config, attention: Attention, mlp: GatedMLP) -> None:
        super().__init__()
        self.self_attn = attention
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope, kv_cache, meta):
        h = x if residual is None else residual + x
        h = h + self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Olmo2DecoderLayer
    norm_class = Olmo2RMSNorm

    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        bias = getattr(config, "attention_bias", False)
        return [AttentionSpec(window, bias, bias, full_width_qk_norm=True) for window in layer_windows(config)]

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor | LazyTensor]) -> None:
        """Llama's loading, with the q/k norm weights cut to this rank's heads."""
        super().load_hf_state_dict(full_width_norm_rows(self, state))


def full_width_norm_rows(model: LlamaForCausalLM, state: Mapping[str, torch.Tensor | LazyTensor]) -> StateView:
    """``state`` with each layer's full-width q/k norm weights cut to ``model``'s rank's heads."""
    head_dim, shard = model.layers[0].self_attn.head_dim, model.shard
    rows = {
        "q_norm": (shard.q_heads.start * head_dim, shard.q_heads.stop * head_dim),
        "k_norm": (shard.kv_heads.start * head_dim, shard.kv_heads.stop * head_dim),
    }
    extra = {}
    for i in range(len(model.layers)):
        for norm, (start, stop) in rows.items():
            name = f"model.layers.{i}.self_attn.{norm}.weight"
            extra[name] = Rows(state[name], start, stop)
    return StateView(state, extra)
