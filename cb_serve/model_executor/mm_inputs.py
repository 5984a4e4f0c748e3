"""A step's image inputs: which of the flattened batch's tokens take which image's embeddings (the pieces
of each image its prefill chunks hold), the encoder run for the images the cache lacks
(``multimodal.encoder_cache``), and the spans in which image tokens attend both ways where the model says
so (``bidirectional_images``: Gemma 3).

M-RoPE (Qwen3-VL, ``spatial_merge_size``): an image of ``h x w`` merged tokens takes positions ``(T, H, W) =
(s, s + row, s + col)`` from ``s``, its first token's, and moves the text after it by ``max(h, w)`` positions,
not ``h * w`` (HF's ``get_rope_index``): ``mrope_positions`` shifts every later token's position (decodes too)
and gives the image tokens' three."""

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
    mrope: np.ndarray | None = None  # [image tokens, 3]: their (T, H, W) positions, in ``token_indices`` order

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


def plan_images(
    model, seqs: Seq[Sequence], starts: Seq[int], query_lens: Seq[int], cu_q: np.ndarray, positions: np.ndarray
) -> MultiModalStep | None:
    """The step's image pieces (``plan_step``, with Gemma 3's spans where ``model.bidirectional_images``), and
    for an M-RoPE model (``model.spatial_merge_size``) ``positions`` moved past the images (``mrope_positions``)."""
    step = plan_step(seqs, starts, query_lens, cu_q, getattr(model, "bidirectional_images", False))
    merge = getattr(model, "spatial_merge_size", None)
    if merge is not None and any(s.mm_features for s in seqs):
        mrope_positions(seqs, starts, query_lens, cu_q, positions, merge, step)
    return step


def _merged_shape(f: MultiModalFeature, merge: int) -> tuple[int, int]:
    assert f.grid is not None and f.grid[0] == 1, f
    return f.grid[1] // merge, f.grid[2] // merge


def mrope_positions(
    seqs: Seq[Sequence], starts: Seq[int], query_lens: Seq[int], cu_q: np.ndarray, positions: np.ndarray,
    merge: int, step: MultiModalStep | None,
) -> None:  # fmt: skip
    """Shifts ``positions`` (in place: each token's, flattened) past the images before them, and sets
    ``step.mrope`` for the image tokens the step holds."""
    shifts: dict[int, int] = {}  # id(feature) -> the shift of every position before it
    for r, seq in enumerate(seqs):
        shift = 0
        first, end = starts[r], starts[r] + query_lens[r]
        base = int(cu_q[r]) - first  # batch index of token index i: base + i
        for f in seq.mm_features:
            shifts[id(f)] = shift
            h, w = _merged_shape(f, merge)
            change = max(h, w) - f.length
            if change and max(f.end, first) < end:
                positions[base + max(f.end, first) : base + end] += change
            shift += change
    if step is None:
        return
    rows = []
    for f, lo, hi, _ in step.pieces:
        _, w = _merged_shape(f, merge)
        k = np.arange(lo, hi)
        s = f.offset + shifts[id(f)]
        rows.append(np.stack([np.full_like(k, s), s + k // w, s + k % w], axis=1))
    step.mrope = np.concatenate(rows)


def image_embeddings(
    step: MultiModalStep, cache: EncoderCache, model, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(batch indices, their embeddings ``[n, width]``, their M-RoPE positions ``[n, 3]`` or None) of the step's
    image tokens; the images the cache lacks through ``model.embed_images`` (their features, whose pixels it
    moves to ``device``)."""

    def encode(features: list[MultiModalFeature]) -> Seq[torch.Tensor]:
        return model.embed_images(features, device)

    embeds = cache.get_many([f for f, *_ in step.pieces], encode)
    rows = torch.cat([embeds[f.identifier][lo:hi] for f, lo, hi, _ in step.pieces])
    mrope = None if step.mrope is None else torch.from_numpy(step.mrope).to(device)
    return torch.from_numpy(step.token_indices()).to(device), rows, mrope
