"""A local safetensors checkpoint read lazily: a tensor-parallel rank reads only its slices of
each weight (``safetensors``' ``get_slice``), never the whole model, so N ranks on one host hold
one model's weights in all rather than N. Views over a state dict give a checkpoint the names and slices a
layer reads (``Rows``: a fused projection's part; ``StateView``: other names), still read only when indexed;
``copy_parts`` reads and copies them into a parameter."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from cb_serve.cpu_ops.exact_quant import QuantGroups
from cb_serve.model_executor.layers import activation_quant

FP8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
STORED_FP8 = {"F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None)}
STORED_DTYPES = {  # safetensors' names of the dtypes a checkpoint stores
    **STORED_FP8,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    **{"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16},
    **{"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8},
    "BOOL": torch.bool,
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def safetensors_files(directory: str) -> list[Path] | None:
    """The checkpoint files of a local model directory saved as safetensors (sharded or not); None
    for anything else (a hub id, a GGUF file, PyTorch ``.bin`` weights)."""
    path = Path(directory)
    if (path / INDEX).is_file():
        return sorted({path / name for name in json.loads((path / INDEX).read_text())["weight_map"].values()})
    return [path / SINGLE] if (path / SINGLE).is_file() else None


class LazyTensor:
    """One checkpoint tensor: indexing reads just that slice (``[rows]``, ``[:, columns]``), cast to ``dtype``."""

    def __init__(self, handle, name: str, dtype: torch.dtype) -> None:
        self.handle, self.name, self.dtype = handle, name, dtype

    def __getitem__(self, index) -> torch.Tensor:
        part = self.raw(index)
        if part.dtype in FP8 and self.dtype not in FP8:  # never a silent cast: FP8 values need their scales
            raise ValueError(f"{self.name} is stored in {part.dtype}: it is read with its scales, not cast")
        return part.to(self.dtype)

    def raw(self, index=None) -> torch.Tensor:
        """``[index]`` (None, or any index of a 0-dim tensor: all of it) as stored, not cast."""
        if index is None or not self.shape:  # a scalar (a scale): safetensors' slices cannot index it
            return self.handle.get_tensor(self.name)
        return self.handle.get_slice(self.name)[index]

    @property
    def shape(self) -> list[int]:
        return self.handle.get_slice(self.name).get_shape()

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype it is stored in, as the file's header names it (one torch lacks: the dtype it is read as)."""
        return STORED_DTYPES.get(self.handle.get_slice(self.name).get_dtype()) or self.dtype


class LazyCheckpoint(Mapping[str, LazyTensor]):
    """``name -> LazyTensor`` over every file of a safetensors checkpoint (an HF state dict's names)."""

    def __init__(self, files: list[Path], dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.dtype = dtype
        self.handles = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            self.handles.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, name: str) -> LazyTensor:
        return LazyTensor(self.handles[name], name, self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.handles)

    def __len__(self) -> int:
        return len(self.handles)

    def first_fp8(self) -> str | None:
        """The first tensor stored in FP8 (from the files' headers), or None."""
        return next((name for name, h in self.handles.items() if h.get_slice(name).get_dtype() in STORED_FP8), None)


def materialize(value: torch.Tensor | LazyTensor) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[:]


def copy_parts(target: torch.Tensor, *parts: torch.Tensor | LazyTensor | Rows) -> None:
    """``target`` <- the parts, read here and stacked along the first dimension. Where every part came with
    its low-bit groups (``quant_groups``: a quantized checkpoint's INT4 or FP8, ``QuantizedWeight``),
    ``target`` keeps them stacked the same way, for ``Linear.prepare_for_cpu``; where they came with their
    input quantization (``input_quant``: W8A8), ``target`` keeps the parts' one (``activation_quant.merge``)."""
    tensors = [materialize(p) for p in parts]
    target.copy_(torch.cat(tensors, dim=0))
    if (quant := activation_quant.merge(getattr(t, "input_quant", None) for t in tensors)) is not None:
        target.input_quant = quant
    groups = [getattr(t, "quant_groups", None) for t in tensors]
    if all(g is not None for g in groups) and (stacked := QuantGroups.cat(groups)) is not None:
        target.quant_groups = stacked
    elif hasattr(target, "quant_groups"):
        del target.quant_groups


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
