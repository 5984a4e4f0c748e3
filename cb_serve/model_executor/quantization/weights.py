"""What the quantization methods share: a quantized weight ``[out, in]`` read as floats slice by slice
(``QuantizedWeight``: the layer loaders and tensor-parallel ranks index checkpoint weights by rows
``[a:b]``, columns ``[:, a:b]`` or both, and ``[:]``), and a checkpoint whose quantized weights read that way
(``QuantizedState``: each ``*.weight`` a method stores in its own tensors, those tensors hidden)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import ClassVar

import torch

from cb_serve.cpu_ops.exact_quant import GROUP, QuantGroups, int4_groups, int8_groups
from cb_serve.model_executor.layers.activation_quant import ActivationQuant, ActivationScheme
from cb_serve.model_executor.layers.checkpoint import FP8, LazyTensor

Tensor = torch.Tensor | LazyTensor


def stored_dtype(tensor: Tensor) -> torch.dtype:
    return tensor.stored_dtype if isinstance(tensor, LazyTensor) else tensor.dtype


def read(tensor: Tensor, index=None, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """``tensor[index]`` (all of it: None) as stored, then in ``dtype`` (None: as stored)."""
    part = tensor.raw(index) if isinstance(tensor, LazyTensor) else tensor if index is None else tensor[index]
    return part if dtype is None else part.to(dtype)


def group_runs(group_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The group of each run of 32 inputs of a slice (``group_of``: each input's group), and the input order that
    makes the runs: None where the slice's own order does, else the inputs sorted by group (GPTQ's activation
    order, whose groups are permutations of the inputs). None where no order does (a group's inputs in the
    slice not a multiple of 32)."""
    if len(group_of) % GROUP:
        return None
    order, blocks = None, group_of.view(-1, GROUP)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        order = torch.argsort(group_of, stable=True)
        blocks = group_of[order].view(-1, GROUP)
        if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
            return None
    return blocks[:, 0], order


def int4_slice_groups(ints: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      group_of: torch.Tensor) -> QuantGroups | None:  # fmt: skip
    """The groups of an INT4 slice ``(ints - zeros[g]) * scales[g]`` (``ints`` ``[out, in]`` in 0..15, ``zeros`` /
    ``scales`` ``[out, groups]``, ``group_of`` each input's group): where each run of 32 inputs shares a group,
    in the slice's order or sorted by group (``group_runs``; the groups then carry the order as ``perm``), and
    ``exact_quant.int4_groups`` takes them."""
    if (runs := group_runs(group_of)) is None:
        return None
    first, order = runs
    groups = int4_groups(ints if order is None else ints[:, order], zeros[:, first], scales[:, first])
    return None if groups is None else groups.permuted(order)


def int8_slice_groups(ints: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      group_of: torch.Tensor) -> QuantGroups | None:  # fmt: skip
    """The same for 8 bits: ``ints - zeros[g]`` as int8 where every one fits (symmetric GPTQ's zero 128,
    compressed-tensors' signed values), ``exact_quant.int8_groups``."""
    if (runs := group_runs(group_of)) is None:
        return None
    first, order = runs
    ints = ints if order is None else ints[:, order]
    groups = int8_groups(ints - zeros[:, first].repeat_interleave(GROUP, dim=1), scales[:, first])
    return None if groups is None else groups.permuted(order)


def blocks_of(part: slice, block: int) -> tuple[slice, torch.Tensor]:
    """The scale rows (or columns) a slice of weight rows (columns) lies in, and each one's index among them."""
    first = part.start // block
    return slice(first, (part.stop - 1) // block + 1), torch.arange(part.start, part.stop) // block - first


class QuantizedWeight(ABC):
    """One quantized weight ``[out, in]`` read as ``dtype`` values: indexing by row and column slices
    dequantizes just that part, in float32 (the formats' own rounding), then casts it. ``input_quant``: how the
    layer's input is quantized (W8A8), which every slice carries to the layer (``checkpoint.copy_parts``)."""

    input_quant: ActivationQuant | None = None

    def __init__(self, name: str, shape: list[int], dtype: torch.dtype) -> None:
        if len(shape) != 2:
            raise ValueError(f"{name}: quantized weights of {len(shape)} dimensions are not supported yet ({shape})")
        self.name, self._shape, self.dtype = name, list(shape), dtype

    @property
    def shape(self) -> list[int]:
        return list(self._shape)

    @abstractmethod
    def dequantize(self, rows: slice, cols: slice) -> torch.Tensor:
        """The float32 values of ``[rows, cols]`` (both non-empty, step 1, within the shape)."""

    def low_bit_groups(self, rows: slice, cols: slice) -> QuantGroups | None:
        """``[rows, cols]`` as 4-bit groups of 32 inputs that give ``dequantize``'s values bit for bit (kept so on
        the CPU, ``low_bit_linear``), or None: a format or slice without them."""
        return None

    def __getitem__(self, index) -> torch.Tensor:
        """The slice's values; a float32 slice that has ``low_bit_groups`` carries them as ``quant_groups``."""
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        if not (isinstance(rows, slice) and isinstance(cols, slice)) or rows.step not in (None, 1):
            raise TypeError(f"{self.name}: quantized weights are read by row and column slices, not {index!r}")
        rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip((rows, cols), self._shape))
        if rows.stop <= rows.start or cols.stop <= cols.start:
            values = torch.zeros(max(rows.stop - rows.start, 0), max(cols.stop - cols.start, 0), dtype=self.dtype)
        else:
            values = self.dequantize(rows, cols).to(self.dtype)
            if self.dtype == torch.float32 and (groups := self.low_bit_groups(rows, cols)) is not None:
                values.quant_groups = groups
        if self.input_quant is not None:
            values.input_quant = self.input_quant
        return values


class QuantizedState(Mapping):
    """A checkpoint (state dict or ``LazyCheckpoint``) whose quantized weights read as ``QuantizedWeight``s: the
    weight ``X.weight`` is stored as ``X.weight`` + ``STORED`` beside its companions ``X.weight`` + each of
    ``COMPANIONS`` (scales...), which are hidden; the input scales are hidden too (``activations``, the
    checkpoint's activation quantization, reads them for each weight). Others are as stored."""

    STORED: ClassVar[str] = ""
    COMPANIONS: ClassVar[tuple[str, ...]] = ()
    UNUSED: ClassVar[tuple[str, ...]] = (".input_scale", ".activation_scale")  # read through the weights

    def __init__(self, state: Mapping, dtype: torch.dtype, activations: ActivationScheme | None = None) -> None:
        self.state, self.dtype, self.activations = state, dtype, activations

    @abstractmethod
    def quantized(self, name: str) -> QuantizedWeight | None:
        """``name`` (an ``X.weight`` in the checkpoint, stored or not) as a quantized weight; None: a float one."""

    def __getitem__(self, name: str):
        if name.endswith(".weight") and (weight := self.quantized(name)) is not None:
            if self.activations is not None:
                weight.input_quant = self.activations.for_weight(self.state, name)
            return weight
        tensor = self.state[name]
        if stored_dtype(tensor) in FP8:  # (fused experts, say): never cast without their scales
            raise ValueError(f"{name} is stored in {stored_dtype(tensor)}, which is not read with its scales yet")
        return tensor

    def hidden(self, name: str) -> bool:
        if name.endswith(self.UNUSED):
            return True
        for suffix in self.COMPANIONS:
            base = name[: -len(suffix)]
            if name.endswith(".weight" + suffix) and (base in self.state or base + self.STORED in self.state):
                return True
        return False

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        stored = self.STORED and name.endswith(".weight") and name + self.STORED in self.state
        return bool(stored) or (name in self.state and not self.hidden(name))

    def __iter__(self) -> Iterator[str]:
        for name in self.state:
            if self.STORED and name.endswith(".weight" + self.STORED):
                yield name[: -len(self.STORED)]
            elif not self.hidden(name):
                yield name

    def __len__(self) -> int:
        return sum(1 for _ in self)
