"""Encoder outputs by image (vLLM v1's encoder cache): an image's embeddings are computed once, at the
first chunk that takes its tokens, and kept under its content hash, so a later chunk, a re-prefill after
preemption and another request with the same image never encode it again. Least recently used entries
go first beyond ``capacity`` embeddings (never below the step's own: a step's images are taken before any
is evicted)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from cb_serve.multimodal.features import MultiModalFeature
from cb_serve.stats import MultiModalStats

ENCODER_BATCH = 8  # images per encoder call: its activations stay bounded whatever a step holds
CAPACITY = 8192  # embeddings kept by default (a Gemma 3 image: 256)


class EncoderCache:
    def __init__(self, capacity: int = CAPACITY) -> None:
        assert capacity > 0, capacity
        self.capacity = capacity  # embeddings (rows of hidden size) kept at most, beyond a step's own
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.size = 0
        self.num_encoded = 0  # images run through the encoder
        self.num_hits = 0  # images a step took from the cache
        self.step = MultiModalStats()  # since the last take_stats()

    def get_many(
        self,
        features: Sequence[MultiModalFeature],
        encode: Callable[[list[MultiModalFeature]], Sequence[torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """Each feature's ``[length, width]`` embeddings, by identifier; the missing ones encoded in batches
        of one input shape (``encode``: images -> their embeddings, in order) and kept."""
        out: dict[str, torch.Tensor] = {}
        missing: dict[str, MultiModalFeature] = {}
        for f in features:
            if f.identifier in out or f.identifier in missing:
                continue
            if (hit := self.entries.get(f.identifier)) is not None:
                self.entries.move_to_end(f.identifier)
                self.num_hits += 1
                out[f.identifier] = hit
            else:
                missing[f.identifier] = f
        if missing:
            todo = list(missing.values())
            for shape in {tuple(f.pixel_values.shape[1:]) for f in todo}:  # batches of one input shape
                group = [f for f in todo if tuple(f.pixel_values.shape[1:]) == shape]
                for i in range(0, len(group), ENCODER_BATCH):
                    batch = group[i : i + ENCODER_BATCH]
                    start = time.perf_counter()
                    embeds = encode(batch)
                    self.step.encoder_s += time.perf_counter() - start
                    for f, e in zip(batch, embeds):
                        assert e.shape[0] == f.length, (e.shape, f.length)
                        out[f.identifier] = e = e.clone()  # (a view would keep its whole batch alive)
                        self._put(f.identifier, e)
            self.num_encoded += len(todo)
            self.step.num_images_encoded += len(todo)
        return out

    def take_stats(self) -> MultiModalStats:
        """The images encoded since the previous call, and the encoder's seconds."""
        stats, self.step = self.step, MultiModalStats()
        return stats

    def _put(self, key: str, value: torch.Tensor) -> None:
        self.entries[key] = value
        self.size += value.shape[0]
        while self.size > self.capacity and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.size -= old.shape[0]

    def clear(self) -> None:
        self.entries.clear()
        self.size = 0
