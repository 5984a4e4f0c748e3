"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): the Gemma 3 text stack (``gemma3.py``), a SigLIP
tower (``siglip.py``) and the projector, which average-pools the tower's patch grid to ``mm_tokens_per_image``
tokens, applies Gemma's ``(1 + w)`` RMSNorm and multiplies by ``mm_input_projection_weight`` ``[vision,
text]``. Its outputs replace the image tokens' embeddings unscaled (the text's are scaled by sqrt(hidden)).
An image's tokens attend to each other both ways during prefill (``bidirectional_images``). Follows
``transformers.models.gemma3.modeling_gemma3``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from cb_serve.model_executor.layers.checkpoint import copy_parts
from cb_serve.model_executor.layers.norm import GemmaRMSNorm
from cb_serve.model_executor.models.gemma3 import Gemma3ForCausalLM
from cb_serve.model_executor.models.siglip import SiglipVisionTower
from cb_serve.multimodal.features import MultiModalFeature

# Where checkpoints keep the tower and the projector: as transformers 5 loads and saves them, as published.
TOWER_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
)
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def find_prefix(state: Mapping, prefixes: tuple[str, ...], name: str) -> str:
    for prefix in prefixes:
        if prefix + name in state:
            return prefix
    raise ValueError(f"the checkpoint has no {name} under {', '.join(prefixes)}")


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        vision = config.vision_config
        patches = vision.image_size // vision.patch_size
        tokens_per_side = int(config.mm_tokens_per_image**0.5)
        if tokens_per_side**2 != config.mm_tokens_per_image or patches % tokens_per_side:
            raise ValueError(f"Gemma 3: {config.mm_tokens_per_image} tokens per image do not pool {patches}^2 patches")
        self.patches_per_side, self.kernel = patches, patches // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, config.text_config.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(images, hidden, self.patches_per_side, self.patches_per_side).contiguous()
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model plus ``embed_images``; ``config`` is the text config, ``mm_config`` the checkpoint's
    whole one (``loader.load_multimodal_config``)."""

    bidirectional_images = True

    def __init__(self, config, *args, mm_config, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        mm = mm_config
        self.image_token_id = mm.image_token_index
        self.vision_tower = SiglipVisionTower(mm.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(mm)

    def embed_images(self, features: Sequence[MultiModalFeature], device: torch.device) -> torch.Tensor:
        """Images of ``[1, 3, H, W]`` pixels -> ``[images, mm_tokens_per_image, hidden]``, in the model's dtype."""
        pixel_values = torch.cat([f.pixel_values for f in features]).to(device, non_blocking=True)
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    @torch.no_grad()
    def load_hf_state_dict(self, state: Mapping) -> None:
        super().load_hf_state_dict(state)
        tower = find_prefix(state, TOWER_PREFIXES, "embeddings.patch_embedding.weight")
        self.vision_tower.load_hf_weights(state, tower)
        prefix = find_prefix(state, PROJECTOR_PREFIXES, "mm_input_projection_weight")
        projector = self.multi_modal_projector
        copy_parts(projector.mm_input_projection_weight, state[prefix + "mm_input_projection_weight"])
        copy_parts(projector.mm_soft_emb_norm.weight, state[prefix + "mm_soft_emb_norm.weight"])
