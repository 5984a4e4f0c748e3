"""SigLIP's vision tower (``SiglipVisionModel`` without its pooling head), as Gemma 3 uses it: patches by a
stride-``patch_size`` convolution, a learned position embedding per patch, pre-norm blocks
(``layers/vision.py``), a final LayerNorm. Follows ``transformers.models.siglip.modeling_siglip``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.model_executor.layers.vision import VisionBlock, load_module


class SiglipVisionTower(nn.Module):
    """``forward(pixel_values [images, 3, H, W]) -> [images, patches, hidden]`` (the last hidden state)."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.image_size % config.patch_size:
            raise ValueError(f"SigLIP: image_size {config.image_size} is not a multiple of patch {config.patch_size}")
        self.patches_per_side = config.image_size // config.patch_size
        hidden = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, config.patch_size, config.patch_size)
        self.position_embedding = nn.Embedding(self.patches_per_side**2, hidden)
        self.layers = nn.ModuleList(
            VisionBlock(
                hidden, config.num_attention_heads, config.intermediate_size, config.hidden_act, config.layer_norm_eps
            )  # fmt: skip
            for _ in range(config.num_hidden_layers)
        )
        self.post_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2) + self.position_embedding.weight  # HF: by arange(num_patches)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """From HF's names under ``prefix`` (``model.vision_tower.vision_model.``): ``embeddings.*``,
        ``encoder.layers.{i}.*``, ``post_layernorm.*``."""
        for name in ("patch_embedding", "position_embedding"):
            load_module(getattr(self, name), state, f"{prefix}embeddings.{name}.")
        for i, layer in enumerate(self.layers):
            load_module(layer, state, f"{prefix}encoder.layers.{i}.")
        load_module(self.post_layernorm, state, prefix + "post_layernorm.")
