"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, llm-compressor's output: RedHatAI's and
many vendors' INT4 and FP8 releases), read as the ``compressed-tensors`` library decompresses them:

- ``pack-quantized`` (W4A16, W8A16): integer weights packed into int32 words along the input dimension
  (``X.weight_packed`` ``[out, in * bits / 32]``: element ``i`` at bit ``i * bits``, offset by
  ``2^(bits-1)``), ``X.weight_scale`` per group of ``group_size`` inputs, per row or per tensor, an asymmetric
  scheme's ``X.weight_zero_point`` packed along the output dimension, ``X.weight_shape``;
- ``naive-quantized``: the same integers unpacked, as int8 ``X.weight``;
- ``float-quantized`` (FP8): ``float8_e4m3fn`` ``X.weight`` with ``X.weight_scale`` per tensor, row or block.

Each value is ``(q - zero_point) * scale`` in float32, the library's arithmetic on the scales transformers
upcasts to a float32 model's dtype, so the weights are what transformers computes with (a half-precision scale
times a small integer or an FP8 value is exact in float32; a float16 or bfloat16 model's cast then rounds once,
as the library's arithmetic in that dtype does). A scheme's ``input_activations`` (W8A8: FP8 or symmetric INT8,
dynamic per token or group, or static per tensor) is the checkpoint's ``activations``. 4-bit slices give their
groups (``low_bit_groups``) for the CPU's low-bit kernels. Not read yet, and refused by name: other formats,
sparsity, transforms, activation-ordered groups (``g_idx``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cb_serve.cpu_ops.exact_quant import QuantGroups
from cb_serve.model_executor.layers.activation_quant import ActivationScheme
from cb_serve.model_executor.layers.checkpoint import FP8 as FP8_DTYPES
from cb_serve.model_executor.quantization.base import QuantizationConfig
from cb_serve.model_executor.quantization.fp8 import Fp8Weight
from cb_serve.model_executor.quantization.weights import (
    QuantizedState,
    QuantizedWeight,
    Tensor,
    int4_slice_groups,
    int8_slice_groups,
    read,
    stored_dtype,
)

FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")  # int-: naive's W8A8 name


@dataclass(frozen=True)
class WeightScheme:
    """A config group's ``weights`` arguments, as far as reading the checkpoint needs them."""

    num_bits: int
    type: str  # int | float
    strategy: str  # tensor | channel | group | block
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.type == "int" and self.num_bits not in (4, 8):
            raise ValueError(f"compressed-tensors: {self.num_bits}-bit integer weights are not supported (4 or 8)")
        if self.type == "float" and self.num_bits != 8:
            raise ValueError(f"compressed-tensors: {self.num_bits}-bit float weights are not supported (FP8)")
        if self.type not in ("int", "float") or self.strategy not in ("tensor", "channel", "group", "block"):
            raise ValueError(f"compressed-tensors: weights of type {self.type!r}, strategy {self.strategy!r}")

    @classmethod
    def from_hf(cls, args: dict[str, Any]) -> WeightScheme:
        block = args.get("block_structure")
        return cls(args["num_bits"], args.get("type", "int"), args.get("strategy") or "tensor",
                   args.get("group_size"), tuple(block) if block else None)  # fmt: skip


def activation_scheme(args: dict[str, Any] | None) -> ActivationScheme | None:
    """A config group's ``input_activations`` as cb-serve applies it; ``ValueError`` for what it cannot."""
    if not args:
        return None
    kind = {("float", 8): "fp8", ("int", 8): "int8"}.get((args.get("type", "int"), args.get("num_bits")))
    strategy, dynamic, group = args.get("strategy") or "tensor", args.get("dynamic", False), args.get("group_size")
    if kind is None or args.get("symmetric", True) is not True or dynamic not in (True, False):
        raise ValueError(f"compressed-tensors: input activations {args} are not supported (FP8, or symmetric INT8, "
                         "with dynamic or static scales)")  # fmt: skip
    if dynamic and strategy in ("token", "tensor"):  # per tensor: per token instead (``activation_quant``)
        return ActivationScheme(kind, True)
    if dynamic and strategy == "group" and group:
        return ActivationScheme(kind, True, int(group))
    if not dynamic and strategy == "tensor":
        return ActivationScheme(kind, False)
    raise ValueError(f"compressed-tensors: input activations with strategy {strategy!r} and dynamic={dynamic} "
                     "are not supported")  # fmt: skip


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantizationConfig):
    name: ClassVar[str] = "compressed-tensors"
    format: str = "pack-quantized"
    scheme: WeightScheme = WeightScheme(4, "int", "group", 128)
    input_scheme: ActivationScheme | None = None
    input_refusal: str | None = None  # input activations it cannot apply: the weights alone load

    @property
    def activation_refusal(self) -> str | None:
        return self.input_refusal

    @classmethod
    def from_hf(cls, params: dict[str, Any]) -> CompressedTensorsConfig:
        for key in ("sparsity_config", "transform_config"):
            if params.get(key) and (params[key] or {}).get("format") != "dense":  # dense: no sparsity
                raise ValueError(f"compressed-tensors: checkpoints with a {key} are not supported yet")
        groups = list((params.get("config_groups") or {}).values())
        if not groups or any(g.get("weights") is None for g in groups):
            raise ValueError("compressed-tensors: every config group needs quantized weights")
        schemes = {WeightScheme.from_hf(g["weights"]) for g in groups}
        formats = {g.get("format") or params.get("format") for g in groups}
        if len(schemes) != 1 or len(formats) != 1:
            raise ValueError("compressed-tensors: config groups with different schemes are not supported yet")
        (scheme,), (fmt,) = schemes, formats
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors: format {fmt!r} is not supported yet; supported: {FORMATS}")
        if any((g["weights"].get("actorder") == "group") for g in groups):
            raise ValueError("compressed-tensors: activation-ordered groups (actorder: group, g_idx) not supported yet")
        try:
            inputs = {activation_scheme(g.get("input_activations")) for g in groups}
            if len(inputs) != 1:
                raise ValueError("compressed-tensors: config groups with different input activations are not supported")
        except ValueError as e:
            return cls(fmt, scheme, None, str(e))
        return cls(fmt, scheme, inputs.pop())

    @property
    def activations(self) -> ActivationScheme | None:
        return self.input_scheme

    def weights(self, state: Mapping, dtype: torch.dtype) -> Mapping:
        return CompressedTensorsState(state, self.scheme, dtype, self.input_scheme)

    def describe(self) -> str:
        s = self.scheme
        kind = f"INT{s.num_bits}" if s.type == "int" else "FP8"
        per = f"groups of {s.group_size}" if s.strategy == "group" else s.strategy
        inputs = self.input_scheme.describe() if self.input_scheme else "unquantized"
        return (
            f"compressed-tensors {self.format}: {kind} weights ({per} scales), dequantized as read; activations "
            + inputs
        )


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[rows, words]`` -> int32 ``[rows, words * 32 / bits]`` signed values (element ``i`` at bit
    ``i * bits`` of the little-endian stream, offset by ``2^(bits-1)``)."""
    rows = words.shape[0]  # (flattened first: a [rows, 1] slice of a transposed tensor has a stride that view refuses)
    data = words.contiguous().reshape(-1).view(torch.uint8).reshape(rows, -1).to(torch.int32)  # little-endian
    if bits == 4:
        data = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)
    return data - (1 << (bits - 1))


class IntWeight(QuantizedWeight):
    """An integer weight (packed in int32 words, or int8): each slice ``(q - zero_point) * scale`` in float32,
    with the scales (and zero points) of its groups, rows or tensor."""

    def __init__(self, name: str, values: Tensor, shape: list[int], scale: Tensor, zero_point: Tensor | None,
                 scheme: WeightScheme, packed: bool, dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__(name, shape, dtype)
        self.values, self.scale, self.zero_point, self.scheme, self.packed = values, scale, zero_point, scheme, packed
        out, inputs = self.shape
        self.per_tensor = scheme.strategy == "tensor"
        self.group = scheme.group_size if scheme.strategy == "group" and scheme.group_size else inputs
        if inputs % self.group:
            raise ValueError(f"{name}: {inputs} inputs are not whole groups of {self.group}")
        scales, expected = list(scale.shape), [out, inputs // self.group]
        if (math.prod(scales) != 1) if self.per_tensor else scales != expected:
            raise ValueError(f"{name}: a weight of shape {shape} needs scales {[1] if self.per_tensor else expected}, "
                             f"not {scales}")  # fmt: skip

    def ints(self, tensor: Tensor, rows: slice, cols: slice, along_rows: bool = False) -> torch.Tensor:
        """The signed integers of ``[rows, cols]``: packed in int32 words along the columns (``along_rows``: along
        the rows, as zero points are), or int8 as stored."""
        if not self.packed:
            return read(tensor, (rows, cols), torch.int32)
        bits = self.scheme.num_bits
        per_word, (inner, outer) = 32 // bits, (rows, cols) if along_rows else (cols, rows)
        first = inner.start // per_word
        words = slice(first, -(-inner.stop // per_word))
        packed = read(tensor, (words, outer) if along_rows else (outer, words), None)
        values = unpack(packed.t() if along_rows else packed, bits)
        values = values[:, inner.start - first * per_word : inner.stop - first * per_word]
        return values.t() if along_rows else values

    def low_bit_groups(self, rows: slice, cols: slice) -> QuantGroups | None:
        out = rows.stop - rows.start
        if self.per_tensor:
            scale = read(self.scale, None, None).reshape(1, 1).expand(out, 1)
            zero = None
            if self.zero_point is not None:
                zero = read(self.zero_point, None, torch.int32).reshape(1, 1).expand(out, 1)
            group_of = torch.zeros(cols.stop - cols.start, dtype=torch.int64)
        else:
            every = slice(0, self.shape[1] // self.group)
            scale = read(self.scale, (rows, every), None)
            zero = None if self.zero_point is None else self.ints(self.zero_point, rows, every, along_rows=True)
            group_of = torch.arange(cols.start, cols.stop) // self.group
        zero = torch.zeros_like(scale, dtype=torch.int32) if zero is None else zero
        ints = self.ints(self.values, rows, cols)
        if self.scheme.num_bits == 4:
            return int4_slice_groups(ints + 8, zero + 8, scale, group_of)
        return int8_slice_groups(ints, zero, scale, group_of)

    def dequantize(self, rows: slice, cols: slice) -> torch.Tensor:
        groups = slice(cols.start // self.group, (cols.stop - 1) // self.group + 1)
        group_of = torch.arange(cols.start, cols.stop) // self.group - groups.start
        if self.per_tensor:
            scale, group_of = read(self.scale, None, None).reshape(1, 1), torch.zeros_like(group_of)
        else:
            scale = read(self.scale, (rows, groups), None)
        values = self.ints(self.values, rows, cols).float()
        if self.zero_point is not None:
            if self.per_tensor:
                zero = read(self.zero_point, None, torch.int32).reshape(1, 1)
            else:
                zero = self.ints(self.zero_point, rows, groups, along_rows=True)
            values = values - zero.float()[:, group_of]
        return values * scale.float()[:, group_of]


class CompressedTensorsState(QuantizedState):
    """A compressed-tensors checkpoint: ``X.weight`` read from ``X.weight_packed`` (or an int8 or FP8
    ``X.weight``) and its scales, zero points and shape, which are hidden."""

    STORED = "_packed"
    COMPANIONS = ("_scale", "_zero_point", "_shape", "_g_idx", "_global_scale")

    def __init__(self, state: Mapping, scheme: WeightScheme, dtype: torch.dtype,
                 activations: ActivationScheme | None = None) -> None:  # fmt: skip
        super().__init__(state, dtype, activations)
        self.scheme = scheme

    def quantized(self, name: str) -> QuantizedWeight | None:
        state, scheme = self.state, self.scheme
        if name + "_g_idx" in state:
            raise ValueError(f"{name}: activation-ordered groups (g_idx) are not supported yet")
        packed = name + "_packed" in state
        stored = state[name + "_packed"] if packed else state[name]
        kind = stored_dtype(stored)
        if not packed and kind not in FP8_DTYPES and kind != torch.int8:
            return None  # a float weight (the LM head, an ignored layer)
        if name + "_scale" not in state:
            raise ValueError(f"{name} is stored quantized and the checkpoint has no {name}_scale for it")
        scale, zero = state[name + "_scale"], state.get(name + "_zero_point")
        if kind in FP8_DTYPES:
            block = scheme.block_structure if scheme.strategy == "block" else None
            return Fp8Weight(name, stored, scale, block, self.dtype)
        shape = [int(n) for n in read(state[name + "_shape"], None, torch.int64)] if packed else list(stored.shape)
        return IntWeight(name, stored, shape, scale, zero, scheme, packed, self.dtype)
