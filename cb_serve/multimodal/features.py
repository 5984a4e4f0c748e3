"""``MultiModalFeature``: one image of a prompt as the engine sees it (vLLM v1's ``MultiModalFeatureSpec``):
its encoder input, a content hash naming it (the encoder cache's key, and a part of the prefix-cache key of
every KV block its placeholder tokens touch), and the run of placeholder tokens its embeddings replace.

The scheduling rule images bring (``fit_chunk``): a prefill chunk never ends inside a placeholder run, so
one image's embeddings always go in together (Gemma 3's image tokens attend to each other both ways, and
the encoder output is consumed whole)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MultiModalFeature:
    """Image ``identifier``'s embeddings replace prompt positions ``offset : offset + length``."""

    identifier: str  # SHA-256 of the processed pixels (``content_hash``)
    offset: int  # the first placeholder position in the prompt
    length: int  # placeholder positions (= the encoder's embeddings for the image)
    pixel_values: torch.Tensor = field(repr=False)  # the image processor's output for this image
    modality: str = "image"
    grid: tuple[int, int, int] | None = None  # its patch grid (t, h, w) where images have any size (Qwen3-VL)

    def __post_init__(self) -> None:
        assert self.offset >= 0 and self.length > 0, (self.offset, self.length)
        assert len(self.identifier) == 64, self.identifier

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions ``start : end`` take some of its embeddings."""
        return self.offset < end and start < self.end


def content_hash(pixel_values: torch.Tensor, *extra: str) -> str:
    """A processed image's name: SHA-256 over its shape, dtype and bytes (and ``extra``: the model)."""
    digest = hashlib.sha256(repr((tuple(pixel_values.shape), str(pixel_values.dtype), extra)).encode())
    digest.update(pixel_values.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fit_chunk(features: Sequence[MultiModalFeature], num_computed: int, num_new: int) -> int:
    """``num_new`` cut so that the chunk ``num_computed : num_computed + num_new`` ends at no placeholder
    run's inside: before the run it would split, or 0 when the chunk starts in a run it cannot finish
    (the budget of a later step takes it whole; a run is never longer than the step's token budget)."""
    end = num_computed + num_new
    for f in features:
        if f.offset < end < f.end:
            return max(0, f.offset - num_computed)
    return num_new


def image_share(features: Sequence[MultiModalFeature], start: int, num_tokens: int) -> dict[str, int]:
    """The image placeholders among a chunk's tokens ``start : start + num_tokens``, and their images."""
    spans = [(max(start, f.offset), min(start + num_tokens, f.end)) for f in features]
    spans = [(lo, hi) for lo, hi in spans if lo < hi]
    return {"image_tokens": sum(hi - lo for lo, hi in spans), "images": len(spans)}
