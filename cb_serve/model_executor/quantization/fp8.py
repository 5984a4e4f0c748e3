"""FP8 weights (``quant_method: fp8``: transformers' fine-grained FP8, DeepSeek V3's and Qwen3's FP8
releases): each ``*.weight`` stored as ``float8_e4m3fn`` with its scales beside it in ``*.weight_scale_inv``
(a multiplier, despite the name; ``*.weight_scale`` in some exports), one per ``weight_block_size`` block
(128 x 128 as published), or one per tensor or output row without blocks.

Today the weights are dequantized as they are read (``Fp8Weights``): each slice a layer or a tensor-parallel
rank reads is multiplied by its blocks' scales in float32, the same single rounding transformers'
dequantization makes, then cast to the model's dtype. Activations are not quantized (a ``static`` activation
scheme's input scales are unused): the result is the dequantized model's, as transformers computes it on a
CPU. A float8 weight without scales, or with scales of another shape than its blocks, is refused at load."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cb_serve.model_executor.layers.checkpoint import FP8 as FP8_DTYPES
from cb_serve.model_executor.layers.checkpoint import LazyTensor
from cb_serve.model_executor.quantization.base import QuantizationConfig

SCALE_SUFFIXES = ("_scale_inv", "_scale")  # after "weight": the multiplier's names, first found wins
UNUSED_SUFFIXES = (".input_scale", ".activation_scale")  # static activation scales: activations stay unquantized


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    name: ClassVar[str] = "fp8"
    weight_block_size: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"

    def __post_init__(self) -> None:
        block = self.weight_block_size
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers, not {block!r}")
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config.activation_scheme {self.activation_scheme!r}: dynamic or static")

    @classmethod
    def from_hf(cls, params: dict[str, Any]) -> Fp8Config:
        block = params.get("weight_block_size")
        return cls(tuple(block) if block is not None else None, params.get("activation_scheme") or "dynamic")

    def weights(self, state: Mapping, dtype: torch.dtype) -> Mapping:
        return Fp8Weights(state, self.weight_block_size, dtype)

    def describe(self) -> str:
        blocks = "x".join(map(str, self.weight_block_size)) if self.weight_block_size else "per tensor or row"
        return f"FP8 weights ({blocks} scales), dequantized as they are read"


def stored_dtype(tensor: torch.Tensor | LazyTensor) -> torch.dtype:
    return tensor.stored_dtype if isinstance(tensor, LazyTensor) else tensor.dtype


def read(tensor: torch.Tensor | LazyTensor, index=None) -> torch.Tensor:
    """``tensor[index]`` (all of it: None) in float32 as stored: FP8 and float32 values convert exactly."""
    if isinstance(tensor, LazyTensor):
        return tensor.raw(index).float()
    return (tensor if index is None else tensor[index]).float()


def blocks_of(part: slice, block: int) -> tuple[slice, torch.Tensor]:
    """The scale rows (or columns) a slice of weight rows (columns) lies in, and each one's index among them."""
    first = part.start // block
    return slice(first, (part.stop - 1) // block + 1), torch.arange(part.start, part.stop) // block - first


class Fp8Weight:
    """One FP8 weight ``[out, in]`` read as floats: indexing by rows (``[a:b]``), columns (``[:, a:b]``) or
    both reads just that part of the weight and of its scales, and multiplies them in float32."""

    def __init__(self, name: str, weight, scale, block: tuple[int, int] | None, dtype: torch.dtype) -> None:
        self.name, self.weight, self.scale, self.block, self.dtype = name, weight, scale, block, dtype
        shape, scales = list(weight.shape), list(scale.shape)
        if len(shape) != 2:
            raise ValueError(f"{name}: FP8 weights of {len(shape)} dimensions are not supported yet (shape {shape})")
        if block is not None:
            grid = [math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])]
            expected, ok = str(grid), scales == grid
        else:
            expected, ok = f"one, or one per row ({shape[0]})", scales in ([], [1], [1, 1], [shape[0]], [shape[0], 1])
        if not ok:
            blocks = f"{block[0]}x{block[1]} blocks" if block else "no blocks"
            raise ValueError(f"{name}: a weight of shape {shape} in {blocks} needs scales {expected}, not {scales}")
        self.per_row = block is None and len(scales) > 0 and scales[0] == shape[0] > 1

    @property
    def shape(self) -> list[int]:
        return list(self.weight.shape)

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        if not (isinstance(rows, slice) and isinstance(cols, slice)) or rows.step not in (None, 1):
            raise TypeError(f"{self.name}: FP8 weights are read by row and column slices, not {index!r}")
        rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip((rows, cols), self.shape))
        weight = read(self.weight, (rows, cols))
        if weight.numel() == 0:
            return weight.to(self.dtype)
        if self.block is None:
            scale = read(self.scale, rows).reshape(-1, 1) if self.per_row else read(self.scale).reshape(1, 1)
        else:
            (row_blocks, row_of), (col_blocks, col_of) = blocks_of(rows, self.block[0]), blocks_of(cols, self.block[1])
            scale = read(self.scale, (row_blocks, col_blocks))[row_of][:, col_of]
        return (weight * scale).to(self.dtype)


class Fp8Weights(Mapping):
    """A checkpoint with each FP8 ``*.weight`` read through ``Fp8Weight`` and its scales hidden; other tensors
    as they are. A float8 weight with no scales beside it is refused."""

    def __init__(self, state: Mapping, block: tuple[int, int] | None, dtype: torch.dtype) -> None:
        self.state, self.block, self.dtype = state, block, dtype

    def scale_name(self, name: str) -> str | None:
        return next((name + s for s in SCALE_SUFFIXES if name + s in self.state), None)

    def __getitem__(self, name: str):
        tensor = self.state[name]
        if not name.endswith(".weight") or stored_dtype(tensor) not in FP8_DTYPES:
            return tensor
        scale = self.scale_name(name)
        if scale is None:
            raise ValueError(f"{name} is stored in {stored_dtype(tensor)} and the checkpoint has no scales for it")
        return Fp8Weight(name, tensor, self.state[scale], self.block, self.dtype)

    def hidden(self, name: str) -> bool:
        return name.endswith(UNUSED_SUFFIXES) or any(
            name.endswith(".weight" + s) and name[: -len(s)] in self.state for s in SCALE_SUFFIXES
        )

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.state and not self.hidden(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.state if not self.hidden(name))

    def __len__(self) -> int:
        return sum(1 for _ in self)
