"""FP8 weights (``quant_method: fp8``: transformers' fine-grained FP8, DeepSeek V3's and Qwen3's FP8
releases): each ``*.weight`` stored as ``float8_e4m3fn`` with its scales beside it in ``*.weight_scale_inv``
(a multiplier, despite the name; ``*.weight_scale`` in some exports), one per ``weight_block_size`` block
(128 x 128 as published), or one per tensor or output row without blocks.

The weights are dequantized as they are read (``Fp8Weights``): each slice a layer or a tensor-parallel rank
reads is multiplied by its blocks' scales in float32, the same single rounding transformers' dequantization
makes, then cast to the model's dtype. On the CPU each slice also gives its codes and scales
(``low_bit_groups``), which the C++ kernels keep instead of the float32 weight (1.125 bytes a weight, the same
products in registers). The ``activation_scheme`` (W8A8) is the checkpoint's ``activations``: dynamic scales per
token, in groups of the blocks' width where the weights have blocks, or each layer's static ``input_scale``; the
loader applies it or not (``activation_quantization``: without it the result is the dequantized model's, as
transformers computes it on a CPU). A float8 weight without scales, or with scales of another shape than its
blocks, is refused at load."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cb_serve.cpu_ops.exact_quant import GROUP, QuantGroups
from cb_serve.model_executor.layers.activation_quant import ActivationScheme
from cb_serve.model_executor.layers.checkpoint import FP8 as FP8_DTYPES
from cb_serve.model_executor.quantization.base import QuantizationConfig
from cb_serve.model_executor.quantization.weights import (
    QuantizedState,
    QuantizedWeight,
    Tensor,
    blocks_of,
    read,
    stored_dtype,
)

SCALE_SUFFIXES = ("_scale_inv", "_scale")  # after "weight": the multiplier's names, first found wins


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

    @property
    def activations(self) -> ActivationScheme:
        dynamic, block = self.activation_scheme == "dynamic", self.weight_block_size
        return ActivationScheme("fp8", dynamic, block[1] if dynamic and block else None)

    def weights(self, state: Mapping, dtype: torch.dtype) -> Mapping:
        return Fp8Weights(state, self.weight_block_size, dtype, self.activations)

    def describe(self) -> str:
        blocks = "x".join(map(str, self.weight_block_size)) if self.weight_block_size else "per tensor or row"
        inputs = self.activations.describe()
        return f"FP8 weights ({blocks} scales), dequantized as they are read; activations {inputs}"


class Fp8Weight(QuantizedWeight):
    """One FP8 weight: each slice multiplied by its blocks' (row's, tensor's) scales in float32."""

    def __init__(self, name: str, weight: Tensor, scale: Tensor, block: tuple[int, int] | None, dtype) -> None:
        super().__init__(name, list(weight.shape), dtype)
        self.weight, self.scale, self.block = weight, scale, block
        shape, scales = self.shape, list(scale.shape)
        if block is not None:
            grid = [math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])]
            expected, ok = str(grid), scales == grid
        else:
            expected, ok = f"one, or one per row ({shape[0]})", scales in ([], [1], [1, 1], [shape[0]], [shape[0], 1])
        if not ok:
            blocks = f"{block[0]}x{block[1]} blocks" if block else "no blocks"
            raise ValueError(f"{name}: a weight of shape {shape} in {blocks} needs scales {expected}, not {scales}")
        self.per_row = block is None and len(scales) > 0 and scales[0] == shape[0] > 1

    def scales(self, index=None) -> torch.Tensor:
        """``scale[index]`` as float32 multipliers; E8M0 exponents stored as
        bytes (MXFP8's) decoded to ``2 ** (byte - 127)``, as transformers decodes them."""
        raw = read(self.scale, index, None)
        if raw.dtype == torch.uint8:
            return (raw.to(torch.float32) - 127.0).exp2()
        if not raw.dtype.is_floating_point:
            raise ValueError(f"{self.name}: scales stored as {raw.dtype} are not supported")
        return raw.to(torch.float32)

    def low_bit_groups(self, rows: slice, cols: slice) -> QuantGroups | None:
        """The e4m3 codes with each group of 32 inputs' float32 scales (constant within it: blocks of a multiple
        of 32 inputs), for ``decode_gemm``'s FP8 groups."""
        if cols.start % GROUP or (cols.stop - cols.start) % GROUP or (self.block and self.block[1] % GROUP):
            return None
        codes = read(self.weight, (rows, cols), None)
        if codes.dtype != torch.float8_e4m3fn:
            return None
        scale = self.scale_of(rows, cols)[:, ::GROUP]  # each group's first input's: the group's
        return QuantGroups(codes, scale.expand(len(codes), codes.shape[1] // GROUP).contiguous(), None)

    def scale_of(self, rows: slice, cols: slice) -> torch.Tensor:
        """float32 ``[len(rows) or 1, len(cols) or 1]``: each weight's scale, broadcast where one serves many."""
        if self.block is None:
            return (self.scales(rows) if self.per_row else self.scales()).reshape(-1, 1)
        (row_blocks, row_of), (col_blocks, col_of) = blocks_of(rows, self.block[0]), blocks_of(cols, self.block[1])
        return self.scales((row_blocks, col_blocks))[row_of][:, col_of]

    def dequantize(self, rows: slice, cols: slice) -> torch.Tensor:
        return read(self.weight, (rows, cols), torch.float32) * self.scale_of(rows, cols)  # FP8 values: exact


class Fp8Weights(QuantizedState):
    """A checkpoint with each FP8 ``*.weight`` read through ``Fp8Weight`` and its scales hidden; other tensors
    as they are. A float8 weight with no scales beside it is refused."""

    COMPANIONS = SCALE_SUFFIXES

    def __init__(self, state: Mapping, block: tuple[int, int] | None, dtype: torch.dtype,
                 activations: ActivationScheme | None = None) -> None:  # fmt: skip
        super().__init__(state, dtype, activations)
        self.block = block

    def quantized(self, name: str) -> Fp8Weight | None:
        tensor = self.state[name]
        if stored_dtype(tensor) not in FP8_DTYPES:
            return None
        scale = next((name + s for s in SCALE_SUFFIXES if name + s in self.state), None)
        if scale is None:
            raise ValueError(f"{name} is stored in {stored_dtype(tensor)} and the checkpoint has no scales for it")
        return Fp8Weight(name, tensor, self.state[scale], self.block, self.dtype)
