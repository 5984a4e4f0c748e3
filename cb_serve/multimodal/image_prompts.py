"""A prompt's images from what a client sent to what the engine schedules (``ImagePrompts``): the limits
checked and the images decoded (``image_inputs``), the model's processor run (``processor``), and each image's
placeholder run within one step's token budget. A rendered chat (``process_chat``: its images taken out of
the messages by ``chat_template.split_images``) gets no second BOS. Also the other way in: features a front
end already processed (the HTTP router's), checked against their token ids before the engine takes them.

An image's pixels are kept once while any request holds them: requests that repeat an image (a shared
screenshot, every later turn of a conversation about it) take the first one's tensor, by the image's hash."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from cb_serve.errors import InvalidRequestError
from cb_serve.multimodal.features import MultiModalFeature
from cb_serve.multimodal.image_inputs import ImageLimits, load_images
from cb_serve.multimodal.processor import MultiModalProcessor, feature_hash, placeholder_runs

PARAM = "messages"


class ImagePrompts:
    """Text with image placeholders plus images → (token ids, features), within ``limits``."""

    def __init__(self, processor: MultiModalProcessor, limits: ImageLimits, max_num_batched_tokens: int) -> None:
        self.processor = processor
        self.limits = limits
        self.budget = max_num_batched_tokens
        self._pixels: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # identifier -> pixel values
        self._lock = threading.Lock()  # prompts are processed on worker threads

    @property
    def placeholder(self) -> str:
        return self.processor.placeholder

    def process(
        self, text: str, images: Any, add_special_tokens: bool = True, param: str = "multi_modal_data"
    ) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """``images``: one image or a list (PIL images, bytes, data or allowed http(s) URLs)."""
        loaded = load_images(images, self.limits, param)
        token_ids, features = self.processor.process(text, loaded, add_special_tokens)
        self._check_lengths(features, param)
        return token_ids, self._share(features)

    def process_chat(self, text: str, images: list[Any]) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """A rendered conversation (its template wrote the special tokens) and its messages' images."""
        placed = text.count(self.placeholder)
        if placed != len(images):
            raise InvalidRequestError(
                f"The chat template placed {placed} image placeholders ({self.placeholder}) for the messages' "
                f"{len(images)} images (a text part that writes the placeholder itself, or a template without "
                "image parts).",
                PARAM,
            )
        return self.process(text, images, add_special_tokens=False, param=PARAM)

    def check(self, token_ids: Sequence[int], features: Any) -> tuple[MultiModalFeature, ...]:
        """Features a front end processed (``multi_modal_features``), checked against the prompt: as many as
        the limit, one per placeholder run and in its place, pixels of the processor's shape, each named by its
        pixels' hash (the encoder cache's key: a wrong name would serve one image's embeddings for another)."""
        param = "multi_modal_features"
        features = tuple(features) if isinstance(features, (list, tuple)) else (features,)
        if not all(isinstance(f, MultiModalFeature) for f in features):
            raise InvalidRequestError("multi_modal_features takes MultiModalFeature objects.", param)
        if len(features) > self.limits.max_images:
            raise InvalidRequestError(f"At most {self.limits.max_images} images per prompt are allowed.", param)
        runs = placeholder_runs(token_ids, self.processor.image_token_id)
        if runs != [(f.offset, f.length) for f in features]:
            raise InvalidRequestError("multi_modal_features do not match the prompt's image placeholders.", param)
        for f in features:
            if (why := self.processor.check_feature(f)) is not None:
                raise InvalidRequestError(why, param)
            if feature_hash(f.pixel_values, f.grid, self.processor.model_type) != f.identifier:
                raise InvalidRequestError("An image's identifier is not its pixels' hash.", param)
        self._check_lengths(features, param)
        return self._share(features)

    def _share(self, features: Sequence[MultiModalFeature]) -> tuple[MultiModalFeature, ...]:
        """The features with each image's pixels the tensor a live earlier feature of the same image holds."""
        with self._lock:
            kept = [self._pixels.setdefault(f.identifier, f.pixel_values) for f in features]
        swap = dataclasses.replace
        return tuple(f if px is f.pixel_values else swap(f, pixel_values=px) for f, px in zip(features, kept))

    def _check_lengths(self, features: Sequence[MultiModalFeature], param: str) -> None:
        if too_long := [f.length for f in features if f.length > self.budget]:
            raise InvalidRequestError(
                f"An image takes {too_long[0]} tokens, more than one step's max_num_batched_tokens ({self.budget}): "
                f"an image's tokens are computed in one step.",
                param,
            )
