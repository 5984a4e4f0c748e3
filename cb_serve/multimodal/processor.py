"""The model's own HF processing turning a text prompt with image placeholders and the images into token ids and
one ``MultiModalFeature`` per image, as transformers prepares them for ``generate``; ``make_processor`` picks
the way for the checkpoint:

- ``AutoProcessorImages`` (Gemma 3): the checkpoint's ``AutoProcessor`` (its tokenizer and PIL-backed image
  processor). ``<start_of_image>`` becomes the image's ``mm_tokens_per_image`` soft tokens between its begin
  and end markers, tokenized with the text around it; every image is resized to one size.
- ``GridImages`` (Qwen3-VL): the checkpoint's image processor (``Qwen2VLImageProcessorPil``: any size,
  rounded to whole 2 x 2 blocks of patches) and tokenizer, and the rule of ``Qwen3VLProcessor``, which needs a
  video processor (torchvision) to be built at all: each ``<|image_pad|>`` becomes ``t * h * w / merge^2`` of
  itself. Each image's feature carries its patch grid ``(t, h, w)``.

The pixels are resized and normalized as the checkpoint's ``preprocessor_config.json`` says. Runs off the
engine thread (HF processors are not thread-safe: a lock); each processor checks itself against the model at
start (one blank image)."""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from cb_serve.errors import InvalidRequestError
from cb_serve.multimodal.features import MultiModalFeature, content_hash

Processed = tuple[list[int], list[tuple[torch.Tensor, tuple[int, int, int] | None]]]  # ids, (pixels, grid)


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


class MultiModalProcessor(ABC):
    """``process(text, images) -> (token ids, features)``; ``check_feature`` for features made elsewhere."""

    placeholder: str  # what a prompt writes per image
    image_token_id: int  # the token its embeddings replace

    def __init__(self, mm_config) -> None:
        self.model_type = mm_config.model_type
        self.lock = threading.Lock()

    @abstractmethod
    def _run(self, text: str, images: list, add_special_tokens: bool) -> Processed:
        """The HF processing: token ids, and each image's pixels and grid (None: a fixed-size model)."""

    @abstractmethod
    def check_feature(self, feature: MultiModalFeature) -> str | None:
        """Why a feature's pixels are not what this model reads (None: they are)."""

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
                token_ids, pixels = self._run(text, images, add_special_tokens)
        except (ValueError, TypeError, OSError) as e:  # e.g. placeholders and images that do not pair up
            raise InvalidRequestError(f"The prompt and its images could not be processed: {e}", "prompt") from e
        runs = placeholder_runs(token_ids, self.image_token_id)
        if len(runs) != len(images) or len(pixels) != len(images):
            raise InvalidRequestError(
                f"The prompt has {len(runs)} image placeholders ({self.placeholder}) for {len(images)} images.",
                "prompt",
            )
        features = tuple(
            MultiModalFeature(feature_hash(px, grid, self.model_type), offset, length, px, grid=grid)
            for (px, grid), (offset, length) in zip(pixels, runs)
        )
        return token_ids, features

    def _blank(self, size: tuple[int, int]) -> MultiModalFeature:
        from PIL import Image

        return self.process(self.placeholder, [Image.new("RGB", size)])[1][0]


def feature_hash(pixels: torch.Tensor, grid: tuple[int, int, int] | None, model_type: str) -> str:
    """An image's name: its processed pixels, its grid where it has one (the same rows may be another
    grid's), and the model."""
    return content_hash(pixels, model_type) if grid is None else content_hash(pixels, model_type, repr(grid))


class AutoProcessorImages(MultiModalProcessor):
    """Fixed-size images through the checkpoint's ``AutoProcessor`` (Gemma 3)."""

    def __init__(self, path: str, mm_config, trust_remote_code: bool = False) -> None:
        from transformers import AutoProcessor

        super().__init__(mm_config)
        try:
            self.hf = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, ImportError) as e:
            raise ValueError(f"{path!r} reads images, but its processor could not be loaded: {e}") from e
        self.image_token_id = mm_config.image_token_index
        self.placeholder = getattr(self.hf, "image_token", None) or "<image>"
        size = mm_config.vision_config.image_size
        self.pixel_shape = (1, 3, size, size)
        feature = self._blank((size, size))  # tokens per image, size; Gemma 3's pan-and-scan crops add images
        expected = (getattr(mm_config, "mm_tokens_per_image", feature.length), self.pixel_shape)
        self.pixel_dtype = feature.pixel_values.dtype
        if (feature.length, tuple(feature.pixel_values.shape)) != expected:
            raise ValueError(
                f"The checkpoint's processor makes {feature.length} tokens and pixels of shape "
                f"{tuple(feature.pixel_values.shape)} per image; its model reads {expected[0]} and {expected[1]}."
            )

    def _run(self, text: str, images: list, add_special_tokens: bool) -> Processed:
        out = self.hf(text=text, images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
        pixels = out["pixel_values"]
        return out["input_ids"][0].tolist(), [(pixels[i : i + 1].clone(), None) for i in range(pixels.shape[0])]

    def check_feature(self, feature: MultiModalFeature) -> str | None:
        got = (feature.pixel_values.dtype, tuple(feature.pixel_values.shape), feature.grid)
        expected = (self.pixel_dtype, self.pixel_shape, None)
        return None if got == expected else f"An image's pixels are {got}, not {expected}."


class GridImages(MultiModalProcessor):
    """Images of any size as patch grids (Qwen3-VL): the image processor, the tokenizer, the expansion rule."""

    def __init__(self, path: str, mm_config, trust_remote_code: bool = False) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        super().__init__(mm_config)
        try:
            self.images = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, ImportError) as e:
            raise ValueError(f"{path!r} reads images, but its image processor could not be loaded: {e}") from e
        self.image_token_id = mm_config.image_token_id
        self.placeholder = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        vision = mm_config.vision_config
        self.merge = vision.spatial_merge_size
        self.row_width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        processor = (self.images.patch_size, self.images.merge_size, self.images.temporal_patch_size)
        model = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
        if processor != model:
            raise ValueError(f"The checkpoint's image processor makes patches (size, merge, temporal) {processor}; "
                             f"its model reads {model}.")  # fmt: skip
        self.pixel_dtype = self._blank((64, 64)).pixel_values.dtype

    def _run(self, text: str, images: list, add_special_tokens: bool) -> Processed:
        out = self.images(images=images, return_tensors="pt")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
        pieces = text.split(self.placeholder)
        expanded = pieces[0]
        for grid, piece in zip(grids, pieces[1:]):
            expanded += self.placeholder * (math.prod(grid) // self.merge**2) + piece
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        rows = torch.split(out["pixel_values"], [math.prod(g) for g in grids])
        return list(ids), [(r.clone(), g) for r, g in zip(rows, grids)]

    def check_feature(self, feature: MultiModalFeature) -> str | None:
        grid, pixels = feature.grid, feature.pixel_values
        if grid is None or len(grid) != 3 or grid[0] != 1 or grid[1] % self.merge or grid[2] % self.merge:
            return f"An image's grid {grid} is not (1, h, w) in whole {self.merge} x {self.merge} blocks."
        if pixels.dtype != self.pixel_dtype or tuple(pixels.shape) != (math.prod(grid), self.row_width):
            return f"An image's pixels are {pixels.dtype} {tuple(pixels.shape)}, not its grid's rows."
        if feature.length != math.prod(grid) // self.merge**2:
            return f"An image of grid {grid} takes {math.prod(grid) // self.merge**2} tokens, not {feature.length}."
        return None


def make_processor(path: str, mm_config, trust_remote_code: bool = False) -> MultiModalProcessor:
    """The processing of the checkpoint at ``path`` (``mm_config``: its whole config)."""
    kind = GridImages if hasattr(mm_config.vision_config, "spatial_merge_size") else AutoProcessorImages
    return kind(path, mm_config, trust_remote_code)
