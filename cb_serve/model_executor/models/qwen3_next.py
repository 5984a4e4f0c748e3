"""Hybrid models whose layers are mostly Gated DeltaNet (linear attention, ``layers/gated_deltanet.py``) with a
full-attention layer every few (``layer_types``): Qwen3.5 (dense MLPs), Qwen3-Next (Qwen2-MoE's experts
with a shared expert, dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say) and Qwen3.5-MoE
(the same experts in every layer, the top k always renormalized).

- Attention layers: a sigmoid output gate projected with q (``AttentionSpec.output_gate``), q/k norms,
  RoPE on the first ``partial_rotary_factor`` of each head.
- Every RMSNorm but the DeltaNet's gated one is zero-centred: ``(1 + w)`` applied in float32
  (``GemmaRMSNorm``).
- Recurrent layers keep a state slot per sequence instead of KV (``models/hybrid.py``).
Each follows ``transformers.models.qwen3_next`` / ``qwen3_5`` / ``qwen3_5_moe`` op for op.
"""

from __future__ import annotations

from torch import nn

from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.layers.gated_deltanet import DeltaNetSpec, GatedDeltaNet
from cb_serve.model_executor.layers.norm import GemmaRMSNorm
from cb_serve.model_executor.models.hybrid import HybridForCausalLM
from cb_serve.model_executor.models.llama import DecoderLayer
from cb_serve.model_executor.models.moe_models import Qwen2MoeForCausalLM, sparse_layer


class GatedAttentionLayer(DecoderLayer):
    norm = GemmaRMSNorm


class Qwen3_5ForCausalLM(HybridForCausalLM):
    decoder_layer = GatedAttentionLayer
    norm_class = GemmaRMSNorm
    mixer_prefix = "linear_attn."

    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        bias = getattr(config, "attention_bias", False)
        spec = AttentionSpec(None, bias, bias, qk_norm=GemmaRMSNorm, output_gate=True)
        return [spec] * config.num_hidden_layers

    def make_mixer(self, index: int) -> nn.Module:
        return GatedDeltaNet(DeltaNetSpec.from_config(self.config), self.shard, self.tp, self.use_cpu_ops)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    def make_mlp(self, index: int) -> nn.Module:
        """Qwen2-MoE's block (experts, a gated shared expert) where the layer is sparse, else the dense MLP."""
        if not sparse_layer(self.config, index):
            return super().make_mlp(index)
        return Qwen2MoeForCausalLM.moe_block(self)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def make_mlp(self, index: int) -> nn.Module:
        return Qwen2MoeForCausalLM.moe_block(self)
