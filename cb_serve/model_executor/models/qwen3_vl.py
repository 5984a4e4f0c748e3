"""Qwen3-VL and Qwen3.5 with images (``Qwen3VLForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration``):
the text stack (Qwen3's ``qwen3.py``; Qwen3.5's hybrid ``qwen3_next.py``), the vision tower
(``qwen3_vl_vision.py``; Qwen3.5's is the same without DeepStack) and the two things images change in the text
model (``MRopeImages``):

- **M-RoPE**: an image token turns its pairs by three positions, interleaved by ``mrope_section`` (frequency
  ``j`` of a head's half by H where ``j % 3 == 1`` and ``j < 3 * section[1]``, by W where ``j % 3 == 2`` and
  ``j < 3 * section[2]``, by T otherwise); a text token's three are equal, the default RoPE at its position
  (shifted past earlier images by ``mm_inputs.mrope_positions``);
- **DeepStack** (Qwen3-VL): the tower's features of early vision blocks are added to the image tokens' hidden
  states after text layers ``0 .. levels - 1``.

An image's encoder output is ``[tokens, hidden * (1 + levels)]``: the merged tokens, then each DeepStack level.
Image tokens attend causally. Follows ``transformers.models.qwen3_vl.modeling_qwen3_vl`` and
``transformers.models.qwen3_5.modeling_qwen3_5``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.gemma3_mm import find_prefix
from cb_serve.model_executor.models.qwen3 import Qwen3ForCausalLM
from cb_serve.model_executor.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from cb_serve.model_executor.models.qwen3_vl_vision import Qwen3VLVisionTower
from cb_serve.multimodal.features import MultiModalFeature

TOWER_PREFIXES = ("model.visual.", "visual.")


def mrope_axes(rotary_dim: int, section: Sequence[int]) -> torch.Tensor:
    """Per rotary column, the axis whose position turns it (0: T, 1: H, 2: W), both halves alike."""
    half = rotary_dim // 2
    axes = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
            for j in range(half)]  # fmt: skip
    return torch.tensor(axes * 2)


class MRopeImages(CausalLM):
    """A text model plus ``embed_images``, M-RoPE and DeepStack; ``config`` is the text config, ``mm_config``
    the checkpoint's whole one (``loader.load_multimodal_config``). Mixed in before the text model's class."""

    default_mrope_section = (24, 20, 20)  # HF's, where the config names none

    def __init__(self, config, *args, mm_config, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        vision = mm_config.vision_config
        self.image_token_id = mm_config.image_token_id
        self.spatial_merge_size = vision.spatial_merge_size  # (the model runner's M-RoPE positions)
        self.visual = Qwen3VLVisionTower(vision)
        self.levels = len(getattr(vision, "deepstack_visual_indexes", None) or ())
        section = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
        self.mrope_section = list(section or self.default_mrope_section)

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
            layer_meta = meta if layer.recurrent else meta.for_layer(i)
            x, residual = layer(x, residual, ropes[layer.rope_table], cache, layer_meta)
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


class Qwen3VLForConditionalGeneration(MRopeImages, Qwen3ForCausalLM):
    pass


class Qwen3_5ForConditionalGeneration(MRopeImages, Qwen3_5ForCausalLM):
    default_mrope_section = (11, 11, 10)


class Qwen3_5MoeForConditionalGeneration(MRopeImages, Qwen3_5MoeForCausalLM):
    default_mrope_section = (11, 11, 10)
