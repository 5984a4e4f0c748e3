"""Views over an HF state dict (or a ``LazyCheckpoint``) that give a model family's checkpoint the
names and slices Llama's loader reads: a fused ``qkv_proj`` seen as ``q_proj``, ``k_proj`` and
``v_proj`` (Phi-3), a weight cut to this rank's rows (OLMo 2's q/k norms). Nothing is read until
the loader indexes a view, so a tensor-parallel rank still reads only its own slice."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from cb_serve.model_executor.layers.checkpoint import LazyTensor


class Rows:
    """Rows ``start:stop`` of a checkpoint tensor: indexing by a row slice reads just those rows."""

    def __init__(self, tensor: torch.Tensor | LazyTensor, start: int, stop: int) -> None:
        self.tensor, self.start, self.stop = tensor, start, stop

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"Rows supports row slices only, not {index!r}")
        begin, end, _ = index.indices(self.stop - self.start)
        return self.tensor[self.start + begin : self.start + end]

    @property
    def shape(self) -> list[int]:
        return [self.stop - self.start, *list(self.tensor.shape)[1:]]


class StateView(Mapping):
    """``state`` with the entries of ``extra`` (name -> tensor, ``LazyTensor`` or ``Rows``) added,
    or replacing its own."""

    def __init__(self, state: Mapping, extra: Mapping) -> None:
        self.state, self.extra = state, extra

    def __getitem__(self, name: str):
        return self.extra[name] if name in self.extra else self.state[name]

    def __contains__(self, name: object) -> bool:
        return name in self.extra or name in self.state

    def __iter__(self) -> Iterator[str]:
        yield from self.extra
        yield from (name for name in self.state if name not in self.extra)

    def __len__(self) -> int:
        return sum(1 for _ in self)
