"""The model's own HF processor (``AutoProcessor``: its tokenizer and PIL-backed image processor) turning a
text prompt with image placeholders and the images into token ids and one ``MultiModalFeature`` per image,
as transformers prepares them for ``generate``: the placeholder expanded by the processor's rules (Gemma 3:
``<start_of_image>`` becomes the image's ``mm_tokens_per_image`` soft tokens between its begin and end
markers, tokenized with the text around it), the pixels resized and normalized as the checkpoint's
``preprocessor_config.json`` says. Runs off the engine thread (HF processors are not thread-safe: a lock)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cb_serve.errors import InvalidRequestError
from cb_serve.multimodal.features import MultiModalFeature, content_hash


def placeholder_runs(token_ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each maximal run of ``token_id`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(token_ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class MultiModalProcessor:
    """``process(text, images) -> (token ids, features)`` for the checkpoint at ``path``."""

    def __init__(self, path: str, mm_config, trust_remote_code: bool = False) -> None:
        from transformers import AutoProcessor

        try:
            self.hf = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, ImportError) as e:
            raise ValueError(f"{path!r} reads images, but its processor could not be loaded: {e}") from e
        self.image_token_id = mm_config.image_token_index
        self.placeholder = getattr(self.hf, "image_token", None) or "<image>"  # what a prompt writes per image
        self.model_type = mm_config.model_type
        self.lock = threading.Lock()
        self._check_against(mm_config)

    def _check_against(self, mm_config) -> None:
        """Raises ``ValueError`` where the processor makes other inputs than the model reads (tokens per
        image, image size; Gemma 3's pan-and-scan crops, which add images): one blank image, processed."""
        from PIL import Image

        size = mm_config.vision_config.image_size
        _, (feature,) = self.process(self.placeholder, [Image.new("RGB", (size, size))])
        expected = (getattr(mm_config, "mm_tokens_per_image", feature.length), (1, 3, size, size))
        self.pixel_shape, self.pixel_dtype = expected[1], feature.pixel_values.dtype  # every image's, checked
        if (feature.length, tuple(feature.pixel_values.shape)) != expected:
            raise ValueError(
                f"The checkpoint's processor makes {feature.length} tokens and pixels of shape "
                f"{tuple(feature.pixel_values.shape)} per image; its model reads {expected[0]} and {expected[1]}."
            )

    def process(
        self, text: str, images: list, add_special_tokens: bool = True
    ) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """``add_special_tokens``: False for a rendered chat, whose template wrote its own BOS."""
        if not images:
            raise InvalidRequestError("multi_modal_data has no image.", "multi_modal_data")
        if (n := text.count(self.placeholder)) != len(images):
            raise InvalidRequestError(
                f"The prompt has {n} image placeholders ({self.placeholder}) for {len(images)} images.", "prompt"
            )
        try:
            with self.lock:
                out = self.hf(text=text, images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
        except (ValueError, TypeError, OSError) as e:  # e.g. placeholders and images that do not pair up
            raise InvalidRequestError(f"The prompt and its images could not be processed: {e}", "prompt") from e
        token_ids = out["input_ids"][0].tolist()
        runs = placeholder_runs(token_ids, self.image_token_id)
        pixels = out["pixel_values"]
        if len(runs) != len(images) or pixels.shape[0] != len(images):
            raise InvalidRequestError(
                f"The prompt has {len(runs)} image placeholders ({self.placeholder}) for {len(images)} images.",
                "prompt",
            )
        images = [pixels[i : i + 1].clone() for i in range(len(runs))]  # each its own tensor, [1, 3, H, W]
        features = tuple(
            MultiModalFeature(content_hash(px, self.model_type), offset, length, px)
            for px, (offset, length) in zip(images, runs)
        )
        return token_ids, features
