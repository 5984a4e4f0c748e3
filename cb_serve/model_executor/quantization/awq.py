"""AWQ checkpoints (``quant_method: awq``, ``version: gemm``: AutoAWQ's and GPTQModel's output, Qwen's and
many vendors' ``-AWQ`` releases): ``X.qweight`` int32 ``[in, out / 8]``, eight 4-bit values to a word along the
*output* dimension in AWQ's interleaved order (word ``c``'s nibble ``i`` holds output ``8c + [0, 2, 4, 6, 1, 3,
5, 7][i]``), ``X.qzeros`` ``[groups, out / 8]`` packed the same way, ``X.scales`` ``[groups, out]``.

Each weight is ``(q - zero) * scale`` in float32 (``qweight.GroupedIntWeight``), AutoAWQ's ``dequantize_gemm``
in a float32 model; read as loaded, slice by slice for tensor-parallel ranks. Other kernels' layouts
(``gemv``, ``gemv_fast``, Marlin) and checkpoints without zero points are refused by name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cb_serve.model_executor.quantization.base import QuantizationConfig
from cb_serve.model_executor.quantization.qweight import (
    GroupedIntWeight,
    QWeightState,
    check_group_size,
    per_group,
    unpack_unsigned,
    word_span,
)
from cb_serve.model_executor.quantization.weights import Tensor, read

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each nibble of a word holds, by nibble
UNORDER = tuple(ORDER.index(j) for j in range(8))  # the nibble each output of a word is in


@dataclass(frozen=True)
class AWQConfig(QuantizationConfig):
    name: ClassVar[str] = "awq"
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"AWQ: {self.bits}-bit weights are not supported (4)")
        check_group_size("AWQ", self.group_size)
        if self.version != "gemm":
            raise ValueError(f"AWQ: version {self.version!r} (its kernel's own layout) is not supported; "
                             f"supported: gemm")  # fmt: skip
        if not self.zero_point:
            raise ValueError("AWQ: checkpoints without zero points (zero_point: false) are not supported yet")

    @classmethod
    def from_hf(cls, params: dict[str, Any]) -> AWQConfig:
        bits = params.get("bits", params.get("w_bit", 4))  # (w_bit, q_group_size: AutoAWQ's own quant_config names)
        group = params.get("group_size", params.get("q_group_size", 128))
        return cls(bits, group, params.get("zero_point", True), str(params.get("version") or "gemm").lower())

    def weights(self, state: Mapping, dtype: torch.dtype) -> Mapping:
        return AwqState(state, self, dtype)

    def describe(self) -> str:
        per = per_group(self.group_size)
        return f"AWQ ({self.version}): INT{self.bits} weights ({per}, zero points), dequantized as read"


class AwqWeight(GroupedIntWeight):
    def order(self, values: torch.Tensor) -> torch.Tensor:
        rows, cols = values.shape
        return values.view(rows, cols // 8, 8)[..., list(UNORDER)].reshape(rows, cols)

    def ints(self, rows: slice, cols: slice) -> torch.Tensor:
        words, inner = word_span(rows, self.per_word)
        packed = read(self.parts["qweight"], (cols, words), None)  # [in, words], packed along the outputs
        return self.order(unpack_unsigned(packed, self.bits))[:, inner]


class AwqState(QWeightState):
    def weight(self, name: str, parts: dict[str, Tensor]) -> AwqWeight:
        inputs, words = parts["qweight"].shape
        if "g_idx" in parts:
            raise ValueError(f"{name}: an AWQ checkpoint with g_idx (activation order) is not supported")
        return AwqWeight(name, parts, [words * 8, inputs], 4, self.config.group_size, self.dtype)
