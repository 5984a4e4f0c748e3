"""Hybrid models whose layers are mostly Gated DeltaNet (linear attention, ``layers/gated_deltanet.py``) with a
full-attention layer every few (``layer_types``): Qwen3.5 (dense MLPs) and Qwen3-Next (Qwen2-MoE's experts
with a shared expert, dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say).

- Attention layers: a sigmoid output gate projected with q (``AttentionSpec.output_gate``), q/k norms,
  RoPE on the first ``partial_rotary_factor`` of each head.
- Every RMSNorm but the DeltaNet's gated one is zero-centred: ``(1 + w)`` applied in float32
  (``GemmaRMSNorm``).
- Recurrent layers keep no KV: their state lives in a slot per sequence (``StateSpec``, ``state_layers``);
  the model's ``kv_caches`` entry for such a layer is its ``(conv, ssm)`` state tensors.
Each follows ``transformers.models.qwen3_next`` / ``qwen3_5`` op for op.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.kv_cache_interface import StateSpec
from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.layers.gated_deltanet import DeltaNetSpec, GatedDeltaNet
from cb_serve.model_executor.layers.moe import FusedMoE
from cb_serve.model_executor.layers.norm import GemmaRMSNorm
from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.models.llama import DecoderLayer, LlamaForCausalLM
from cb_serve.model_executor.models.moe_models import Qwen2MoeForCausalLM, sparse_layer


class GatedAttentionLayer(DecoderLayer):
    norm = GemmaRMSNorm


class LinearAttentionLayer(nn.Module):
    """``DecoderLayer`` with the Gated DeltaNet in attention's place (``(x, residual)`` in and out)."""

    def __init__(self, config, mixer: GatedDeltaNet, mlp: nn.Module, fused: bool) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.linear_attn = mixer
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, state, meta: AttentionMetadata):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, state, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    decoder_layer = GatedAttentionLayer
    norm_class = GemmaRMSNorm

    @classmethod
    def state_layers(cls, config) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(config.layer_types) if t == "linear_attention")

    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        bias = getattr(config, "attention_bias", False)
        spec = AttentionSpec(None, bias, bias, qk_norm=GemmaRMSNorm, output_gate=True)
        return [spec] * config.num_hidden_layers

    def make_layer(self, index: int, spec: AttentionSpec, backend: AttentionBackend) -> nn.Module:
        if index not in self.state_layers(self.config):
            return super().make_layer(index, spec, backend)
        mixer = GatedDeltaNet(DeltaNetSpec.from_config(self.config), self.shard, self.tp)
        return LinearAttentionLayer(self.config, mixer, self.make_mlp(index), self.use_cpu_ops)

    def state_specs(self) -> dict[int, StateSpec]:
        """Each recurrent layer's state per sequence."""
        return {i: self.layers[i].linear_attn.spec.state_spec() for i in self.state_layers(self.config)}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        rope = Rope(positions, self.rope_cos[0], self.rope_sin[0], x.dtype, self.use_cpu_ops)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if isinstance(layer, LinearAttentionLayer):
                x, residual = layer(x, residual, cache, meta)
            else:
                x, residual = layer(x, residual, rope, cache, meta.for_layer(i))
        return residual + x

    def load_mixer_weights(self, layer: nn.Module, state: Mapping, src: str, dst: str, put) -> None:
        if isinstance(layer, LinearAttentionLayer):
            layer.linear_attn.load_hf_weights(state, src + "linear_attn.")
        else:
            super().load_mixer_weights(layer, state, src, dst, put)

    def prepare_for_cpu(self) -> None:
        """``LlamaForCausalLM.prepare_for_cpu``'s layouts, the DeltaNet's projections among them."""
        for layer in self.layers:
            mixer = layer.linear_attn if isinstance(layer, LinearAttentionLayer) else layer.self_attn
            projections = (
                (mixer.in_proj, mixer.out_proj) if isinstance(mixer, GatedDeltaNet) else (mixer.qkv_proj, mixer.o_proj)
            )
            mlp = layer.mlp
            dense = () if isinstance(mlp, FusedMoE) else (mlp.gate_up_proj, mlp.down_proj)
            for linear in (*projections, *dense):
                linear.prepare_for_cpu(pack=self.use_cpu_ops)
            if isinstance(mlp, FusedMoE):
                mlp.prepare_for_cpu(pack=self.use_cpu_ops)
        tied = self.lm_head.weight is self.embed_tokens.weight
        self.lm_head.prepare_for_cpu(pack=self.use_cpu_ops, transpose=not tied)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    def make_mlp(self, index: int) -> nn.Module:
        """Qwen2-MoE's block (experts, a gated shared expert) where the layer is sparse, else the dense MLP."""
        if not sparse_layer(self.config, index):
            return super().make_mlp(index)
        return Qwen2MoeForCausalLM.moe_block(self)
