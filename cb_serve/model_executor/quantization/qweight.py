"""What GPTQ and AWQ checkpoints share (AutoGPTQ's, GPTQModel's and AutoAWQ's layout): a linear layer ``X``
stored as ``X.qweight`` (integers packed into int32 words), ``X.qzeros`` (zero points packed the same way along
the output dimension), ``X.scales`` (``[groups, out]``, float16 as published) and, for GPTQ, ``X.g_idx`` (each
input's group). ``QWeightState`` reads such a checkpoint with each ``X.weight`` a ``QuantizedWeight`` and
those tensors hidden; ``GroupedIntWeight`` dequantizes a slice as ``(q - zero) * scale`` in float32 (the
formats' reference kernels, GPTQModel's torch kernel and AutoAWQ's ``dequantize_gemm``, in a float32 model: a
float16 scale times a small integer is exact, so in a float16 or bfloat16 model the cast rounds once, as their
half-precision arithmetic does), and gives a 4-bit slice's groups (``QuantizedWeight.low_bit_groups``) for the
CPU's low-bit kernels."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping

import torch

from cb_serve.cpu_ops.exact_quant import QuantGroups
from cb_serve.model_executor.quantization.compressed_tensors import unpack
from cb_serve.model_executor.quantization.weights import (
    QuantizedState,
    QuantizedWeight,
    Tensor,
    int4_slice_groups,
    int8_slice_groups,
    read,
)

PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized layer's tensors, after its prefix


def check_group_size(method: str, group_size: object) -> None:
    """A config's ``group_size``: -1 (one group per output row) or a positive integer, else ``ValueError``."""
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"{method}: group_size must be -1 or a positive integer, not {group_size!r}")


def per_group(group_size: int) -> str:
    """``describe``'s words for the scales' grouping."""
    return f"groups of {group_size}" if group_size > 0 else "per row"


def unpack_unsigned(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[rows, words]`` -> int32 ``[rows, words * 32 / bits]``: element ``i`` of a row is bits
    ``[i * bits, (i + 1) * bits)`` of the row's little-endian word stream, unsigned."""
    return unpack(words, bits) + (1 << (bits - 1))


def word_span(part: slice, per_word: int) -> tuple[slice, slice]:
    """The words that hold elements ``part`` (``per_word`` to a word), and ``part`` within their elements."""
    first = part.start // per_word
    words = slice(first, -(-part.stop // per_word))
    return words, slice(part.start - first * per_word, part.stop - first * per_word)


class GroupedIntWeight(QuantizedWeight):
    """One GPTQ or AWQ weight ``[out, in]``: integers ``q`` with per-group zero points and scales, each
    slice ``(q - zero) * scale`` in float32."""

    def __init__(self, name: str, parts: dict[str, Tensor], shape: list[int], bits: int, group: int,
                 dtype: torch.dtype, zero_offset: int = 0) -> None:  # fmt: skip
        """``zero_offset``: added to each stored zero point (GPTQ's original format stores ``zero - 1``)."""
        super().__init__(name, shape, dtype)
        self.parts, self.bits, self.per_word, self.zero_offset = parts, bits, 32 // bits, zero_offset
        out, inputs = shape
        self.group = group if group > 0 else inputs  # -1: one group per output row
        if "g_idx" not in parts and inputs % self.group:
            raise ValueError(f"{name}: {inputs} inputs are not whole groups of {self.group}")
        self.groups = max(inputs // self.group, 1) if "g_idx" not in parts else list(parts["scales"].shape)[0]
        self.expect("scales", [self.groups, out])
        self.expect("qzeros", [self.groups, -(-out // self.per_word)])
        if "g_idx" in parts:
            self.expect("g_idx", [inputs])

    def expect(self, part: str, shape: list[int]) -> None:
        if list(self.parts[part].shape) != shape:
            raise ValueError(f"{self.name}: a weight of shape {self.shape} in {self.bits}-bit groups of {self.group} "
                             f"needs {part} of shape {shape}, not {list(self.parts[part].shape)}")  # fmt: skip

    def group_of(self, cols: slice) -> torch.Tensor:
        """Each input's group: ``g_idx`` where stored (GPTQ's activation order), else ``input // group``."""
        if "g_idx" in self.parts:
            g = read(self.parts["g_idx"], cols, torch.int64)
            if g.numel() and (g.min() < 0 or g.max() >= self.groups):
                raise ValueError(f"{self.name}: g_idx names groups outside 0..{self.groups - 1}")
            return g
        return torch.arange(cols.start, cols.stop) // self.group

    def zeros(self, rows: slice) -> torch.Tensor:
        """int32 ``[groups, len(rows)]``: the zero points of output rows ``rows``, packed along them."""
        words, inner = word_span(rows, self.per_word)
        return self.order(unpack_unsigned(read(self.parts["qzeros"], (slice(None), words), None), self.bits))[:, inner]

    def order(self, values: torch.Tensor) -> torch.Tensor:
        """Values unpacked along the output dimension, in output order (AWQ interleaves them)."""
        return values

    @abstractmethod
    def ints(self, rows: slice, cols: slice) -> torch.Tensor:
        """int32 ``[len(cols), len(rows)]``: the stored integers of inputs ``cols`` and outputs ``rows``."""

    def low_bit_groups(self, rows: slice, cols: slice) -> QuantGroups | None:
        """4 bits as they are; 8 bits where ``q - zero`` fits int8 (symmetric: zero 128)."""
        scale = read(self.parts["scales"], (slice(None), rows), None).t()
        zeros = (self.zeros(rows) + self.zero_offset).t()
        groups = int4_slice_groups if self.bits == 4 else int8_slice_groups
        return groups(self.ints(rows, cols).t(), zeros, scale, self.group_of(cols))

    def dequantize(self, rows: slice, cols: slice) -> torch.Tensor:
        scale = read(self.parts["scales"], (slice(None), rows), None)
        if not scale.dtype.is_floating_point:
            raise ValueError(f"{self.name}: scales stored as {scale.dtype} are not supported")
        group = self.group_of(cols)
        ints = self.ints(rows, cols) - (self.zeros(rows) + self.zero_offset)[group]  # [in, out], exact
        return (ints.float() * scale.float()[group]).t()


class QWeightState(QuantizedState):
    """A GPTQ / AWQ checkpoint: ``X.weight`` read from ``X.qweight`` and its companions (``weight``), which
    are hidden; float layers (``modules_to_not_convert``, the LM head) as stored."""

    def __init__(self, state: Mapping, config, dtype: torch.dtype) -> None:
        super().__init__(state, dtype)
        self.config = config  # the method's QuantizationConfig

    @abstractmethod
    def weight(self, name: str, parts: dict[str, Tensor]) -> QuantizedWeight:
        """``name``'s weight from its stored ``parts`` (``PARTS`` present, by part name)."""

    def quantized(self, name: str) -> QuantizedWeight | None:
        prefix = name[: -len("weight")]
        if prefix + "qweight" not in self.state:
            return None
        parts = {p: self.state[prefix + p] for p in PARTS if prefix + p in self.state}
        for needed in ("qzeros", "scales"):
            if needed not in parts:
                raise ValueError(f"{name} is stored quantized ({prefix}qweight) and the checkpoint has no "
                                 f"{prefix}{needed} for it")  # fmt: skip
        return self.weight(name, parts)

    def hidden(self, name: str) -> bool:
        prefix, _, part = name.rpartition(".")
        return part in PARTS and prefix + ".qweight" in self.state or super().hidden(name)

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str) and name.endswith(".weight") and name[:-6] + "qweight" in self.state:
            return True
        return super().__contains__(name)

    def __iter__(self) -> Iterator[str]:
        for name in self.state:
            if name.endswith(".qweight"):
                yield name[: -len("qweight")] + "weight"
            elif not self.hidden(name):
                yield name
