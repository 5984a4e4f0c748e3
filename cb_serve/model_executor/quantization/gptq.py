"""GPTQ checkpoints (``quant_method: gptq``: AutoGPTQ's and GPTQModel's output, Qwen's and many vendors'
``-GPTQ-Int4`` / ``-Int8`` releases): ``X.qweight`` int32 ``[in * bits / 32, out]``, the integers packed along
the *input* dimension (element ``i`` of a column at bits ``i * bits`` of its words), ``X.qzeros`` packed along
the output dimension, ``X.scales`` ``[groups, out]``, and ``X.g_idx`` ``[in]``, each input's group (with
``desc_act``, activation order, any permutation of the groups).

The original format (``checkpoint_format: gptq``) stores each zero point minus one, GPTQ v2 (``gptq_v2``) as
it is; each weight is ``(q - zero) * scale`` in float32, as GPTQModel's torch kernel computes it in a float32
model, so the dequantized weights are what it multiplies by. Read as they are loaded, slice by slice for
tensor-parallel ranks; 2- and 3-bit weights and Marlin-repacked checkpoints are refused by name."""

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

FORMATS = ("gptq", "gptq_v2")  # checkpoint_format: zero points stored minus one, or as they are


@dataclass(frozen=True)
class GPTQConfig(QuantizationConfig):
    name: ClassVar[str] = "gptq"
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    checkpoint_format: str = "gptq"

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ: {self.bits}-bit weights are not supported yet (4 or 8)")
        check_group_size("GPTQ", self.group_size)
        if self.checkpoint_format not in FORMATS:
            raise ValueError(f"GPTQ: checkpoint_format {self.checkpoint_format!r} is not supported; supported: "
                             f"{', '.join(FORMATS)}")  # fmt: skip

    @classmethod
    def from_hf(cls, params: dict[str, Any]) -> GPTQConfig:
        fmt = params.get("checkpoint_format") or params.get("format") or "gptq"
        if params.get("is_marlin_format"):
            fmt = "marlin"
        return cls(params.get("bits", 4), params.get("group_size", 128), bool(params.get("desc_act")), fmt)

    def weights(self, state: Mapping, dtype: torch.dtype) -> Mapping:
        return GptqState(state, self, dtype)

    def describe(self) -> str:
        order = ", activation order" if self.desc_act else ""
        per = per_group(self.group_size)
        return f"GPTQ ({self.checkpoint_format}): INT{self.bits} weights ({per}{order}), dequantized as read"


class GptqWeight(GroupedIntWeight):
    def ints(self, rows: slice, cols: slice) -> torch.Tensor:
        words, inner = word_span(cols, self.per_word)
        packed = read(self.parts["qweight"], (words, rows), None)  # [words, out], packed along the inputs
        return unpack_unsigned(packed.t(), self.bits).t()[inner]


class GptqState(QWeightState):
    def weight(self, name: str, parts: dict[str, Tensor]) -> GptqWeight:
        words, out = parts["qweight"].shape
        config = self.config
        return GptqWeight(name, parts, [out, words * 32 // config.bits], config.bits, config.group_size, self.dtype,
                          zero_offset=1 if config.checkpoint_format == "gptq" else 0)  # fmt: skip
