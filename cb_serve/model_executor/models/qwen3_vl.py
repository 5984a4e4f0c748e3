"""Qwen3-VL with images (``Qwen3VLForConditionalGeneration``): Qwen3's text stack (``qwen3.py``), the vision
tower (``qwen3_vl_vision.py``) and the two things images change in the text model (``Qwen3VLTextModel``):

- **M-RoPE**: an image token turns its pairs by three positions, interleaved by ``mrope_section`` (frequency
  ``j`` of a head's half by H where ``j % 3 == 1`` and ``j < 3 * section[1]``, by W where ``j % 3 == 2`` and
  ``j < 3 * section[2]``, by T otherwise); a text token's three are equal, the default RoPE at its position
  (shifted past earlier images by ``mm_inputs.mrope_positions``);
- **DeepStack**: the tower's features of early vision blocks are added to the image tokens' hidden states after
  text layers ``0 .. levels - 1``.

An image's encoder output is ``[tokens, hidden * (1 + levels)]``: the merged tokens, then each DeepStack level.
Image tokens attend causally. Follows ``transformers.models.qwen3_vl.modeling_qwen3_vl``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.models.gemma3_mm import find_prefix
from cb_serve.model_executor.models.qwen3 import Qwen3ForCausalLM
from cb_serve.model_executor.models.qwen3_vl_vision import Qwen3VLVisionTower
from cb_serve.multimodal.features import MultiModalFeature

TOWER_PREFIXES = ("model.visual.", "visual.")


def mrope_axes(rotary_dim: int, section: Sequence[int]) -> torch.Tensor:
    """Per rotary column, the axis whose position turns it (0: T, 1: H, 2: W), both halves alike."""
    half = rotary_dim // 2
    axes = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
            for j in range(half)]  # fmt: skip
    return torch.tensor(axes * 2)


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    """The text model plus ``embed_images``; ``config`` is the text config, ``mm_config`` the checkpoint's
    whole one (``loader.load_multimodal_config``)."""

    def __init__(self, config, *args, mm_config, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        vision = mm_config.vision_config
        self.image_token_id = mm_config.image_token_id
        self.spatial_merge_size = vision.spatial_merge_size  # (the model runner's M-RoPE positions)
        self.visual = Qwen3VLVisionTower(vision)
        self.levels = len(vision.deepstack_visual_indexes)
        self.mrope_section = list((getattr(config, "rope_parameters", None) or {}).get("mrope_section") or [24, 20, 20])

    def embed_images(self, features: Sequence[MultiModalFeature], device: torch.device) -> list[torch.Tensor]:
        """Each image's ``[tokens, hidden * (1 + levels)]``, in the model's dtype."""
        pixels = torch.cat([f.pixel_values for f in features]).to(device, non_blocking=True)
        tokens, deepstack = self.visual(pixels, [f.grid for f in features])
        return list(torch.cat([tokens, *deepstack], dim=-1).split([f.length for f in features]))

    def forward(self, input_ids, positions, kv_caches, meta, mm_embeds=None) -> torch.Tensor:
        if mm_embeds is None:
            return super().forward(input_ids, positions, kv_caches, meta)
        index, rows, mrope = mm_embeds
        hidden = self.config.hidden_size
        x = self.embed(input_ids)
        x = x.index_copy(0, index, rows[:, :hidden].to(x.dtype))
        deepstack = rows[:, hidden:].reshape(rows.shape[0], self.levels, hidden)
        tables = zip(self.rope_cos, self.rope_sin)
        ropes = [self._rope(positions, cos, sin, index, mrope, x.dtype) for cos, sin in tables]
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, ropes[layer.rope_table], cache, meta.for_layer(i))
            if i < self.levels:  # HF: hidden[images] += the level's features, after the layer
                x = (residual + x).index_add(0, index, deepstack[:, i].to(x.dtype))
                residual = torch.zeros_like(x)
        return residual + x

    def _rope(self, positions, cos, sin, index, mrope, dtype) -> Rope:
        """The step's rotary rows; the image tokens' by their three positions."""
        rope = Rope(positions, cos, sin, dtype, use_cpu_ops=False)
        if mrope is not None and cos.shape[-1]:
            columns = torch.arange(cos.shape[-1], device=cos.device)
            axes = mrope_axes(cos.shape[-1], self.mrope_section).to(mrope.device)
            by_column = mrope[:, axes]  # [image tokens, rotary dim]
            rope.cos[index] = cos[by_column, columns].unsqueeze(1).to(dtype)
            rope.sin[index] = sin[by_column, columns].unsqueeze(1).to(dtype)
        return rope

    @torch.no_grad()
    def load_hf_state_dict(self, state: Mapping) -> None:
        super().load_hf_state_dict(state)
        self.visual.load_hf_weights(state, find_prefix(state, TOWER_PREFIXES, "patch_embed.proj.weight"))
