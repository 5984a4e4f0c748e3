"""IBM Granite (3.x dense): Llama with four multipliers from the config:
- ``embedding_multiplier`` on the token embedding;
- ``residual_multiplier`` on each sublayer's output before its residual add;
- ``attention_multiplier`` as the score scale (in place of ``head_dim ** -0.5``);
- ``logits_scaling``: the logits divided by it.
Follows ``transformers.models.granite.modeling_granite`` op for op."""

from __future__ import annotations

import dataclasses

import torch

from cb_serve.model_executor.layers.attention import Attention, AttentionSpec
from cb_serve.model_executor.layers.mlp import GatedMLP
from cb_serve.model_executor.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    """Llama's layer with each sublayer's output scaled before the residual add inside the next norm."""

    def __init__(self, config, attention: Attention, mlp: GatedMLP) -> None:
        super().__init__(config, attention, mlp)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer = GraniteDecoderLayer

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.embedding_multiplier = config.embedding_multiplier
        self.logits_scaling = config.logits_scaling

    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        scale = config.attention_multiplier
        return [dataclasses.replace(spec, scale=scale) for spec in super().attention_specs(config)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(self.lm_head(self.norm(hidden))) / self.logits_scaling  # in the model's dtype
        return logits[:, : self.config.vocab_size].float()
