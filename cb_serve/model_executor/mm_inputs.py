"""A step's image inputs: which of the flattened batch's tokens take which image's embeddings (the pieces
of each image its prefill chunks hold), the encoder run for the images the cache lacks
(``multimodal.encoder_cache``), and the spans in which image tokens attend both ways where the model says
so (``bidirectional_images``: Gemma 3)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from cb_serve.multimodal.encoder_cache import EncoderCache
from cb_serve.multimodal.features import MultiModalFeature
from cb_serve.sequence import Sequence


@dataclass
class MultiModalStep:
    # (feature, its first embedding row in the chunk, the row after its last, the batch index of the first)
    pieces: list[tuple[MultiModalFeature, int, int, int]] = field(default_factory=list)
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # batch row -> images' positions

    def token_indices(self) -> np.ndarray:
        return np.concatenate([np.arange(at, at + hi - lo) for _, lo, hi, at in self.pieces])


def plan_step(
    seqs: Seq[Sequence], starts: Seq[int], query_lens: Seq[int], cu_q: np.ndarray, bidirectional: bool
) -> MultiModalStep | None:
    """The pieces of images the rows' chunks (``starts[r] : starts[r] + query_lens[r]``) hold; None for none."""
    step = MultiModalStep()
    for r, seq in enumerate(seqs):
        if not seq.mm_features:
            continue
        start, end = starts[r], starts[r] + query_lens[r]
        for f in seq.mm_features:
            if not f.overlaps(start, end):
                continue
            lo, hi = max(start, f.offset), min(end, f.end)
            step.pieces.append((f, lo - f.offset, hi - f.offset, int(cu_q[r]) + lo - start))
            if bidirectional:
                step.spans.setdefault(r, []).append((f.offset, f.end))
    return step if step.pieces else None


def image_embeddings(
    step: MultiModalStep, cache: EncoderCache, model, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch indices, their embeddings ``[n, hidden]``) of the step's image tokens; the images the cache
    lacks through ``model.embed_images`` (their pixels, processed on the host, moved to ``device``)."""

    def encode(pixel_values: torch.Tensor) -> torch.Tensor:
        return model.embed_images(pixel_values.to(device, non_blocking=True))

    embeds = cache.get_many([f for f, *_ in step.pieces], encode)
    rows = torch.cat([embeds[f.identifier][lo:hi] for f, lo, hi, _ in step.pieces])
    return torch.from_numpy(step.token_indices()).to(device), rows
