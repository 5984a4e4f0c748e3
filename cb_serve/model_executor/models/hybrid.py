"""What hybrid models share: decoder layers whose mixer is recurrent (Gated DeltaNet, Mamba2) between
attention layers (``config.layer_types``: ``linear_attention`` / ``full_attention``).

A recurrent layer keeps no KV: its state lives in a slot per sequence (``StateSpec``, ``state_layers``),
and the model's ``kv_caches`` entry for it is its ``(conv, ssm)`` state tensors. Subclasses name the
mixer (``make_mixer``) and where its weights are in the checkpoint (``mixer_prefix``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.kv_cache_interface import StateSpec
from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.moe import FusedMoE
from cb_serve.model_executor.layers.norm import RMSNorm
from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.models.llama import LlamaForCausalLM


class RecurrentDecoderLayer(nn.Module):
    """``DecoderLayer`` with a recurrent mixer in attention's place (``(x, residual)`` in and out); each
    sublayer's output times ``residual_multiplier`` (Granite) before its residual add."""

    def __init__(self, config, mixer: nn.Module, mlp: nn.Module, norm: type[RMSNorm], fused: bool) -> None:
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps, fused)
        self.mixer = mixer
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps, fused)
        self.mlp = mlp
        self.residual_multiplier = getattr(config, "residual_multiplier", 1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, state, meta: AttentionMetadata):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mixer(x, state, meta)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return (x * self.residual_multiplier if self.residual_multiplier != 1.0 else x), residual


class HybridForCausalLM(LlamaForCausalLM):
    mixer_prefix: str = ""  # HF's attribute of the recurrent mixer in a layer (``linear_attn.``, ``mamba.``)

    @classmethod
    def state_layers(cls, config) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(config.layer_types) if t == "linear_attention")

    def make_mixer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def make_layer(self, index: int, spec: AttentionSpec, backend: AttentionBackend) -> nn.Module:
        if index not in self.state_layers(self.config):
            return super().make_layer(index, spec, backend)
        mlp = self.make_mlp(index)
        return RecurrentDecoderLayer(self.config, self.make_mixer(index), mlp, self.norm_class, self.use_cpu_ops)

    def state_specs(self) -> dict[int, StateSpec]:
        """Each recurrent layer's state per sequence (this rank's heads)."""
        return {i: self.layers[i].mixer.spec.state_spec() for i in self.state_layers(self.config)}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        rope = Rope(positions, self.rope_cos[0], self.rope_sin[0], x.dtype, self.use_cpu_ops)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if isinstance(layer, RecurrentDecoderLayer):
                x, residual = layer(x, residual, cache, meta)
            else:
                x, residual = layer(x, residual, rope, cache, meta.for_layer(i))
        return residual + x

    def load_mixer_weights(self, layer: nn.Module, state: Mapping, src: str, dst: str, put) -> None:
        if isinstance(layer, RecurrentDecoderLayer):
            layer.mixer.load_hf_weights(state, src + self.mixer_prefix)
        else:
            super().load_mixer_weights(layer, state, src, dst, put)

    def prepare_for_cpu(self) -> None:
        """``LlamaForCausalLM.prepare_for_cpu``'s layouts for every projection of every layer, the mixers'
        among them; each MoE block prepares its own."""
        pack = self.use_cpu_ops
        for layer in self.layers:
            blocks = [m for m in layer.modules() if isinstance(m, FusedMoE)]
            inside = {id(m) for block in blocks for m in block.modules()}
            for block in blocks:
                block.prepare_for_cpu(pack=pack)
            for m in layer.modules():
                if isinstance(m, Linear) and id(m) not in inside:
                    m.prepare_for_cpu(pack=pack)
        tied = self.lm_head.weight is self.embed_tokens.weight
        self.lm_head.prepare_for_cpu(pack=pack, transpose=not tied)
