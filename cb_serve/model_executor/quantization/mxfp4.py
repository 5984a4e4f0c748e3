"""MXFP4 (``quant_method: mxfp4``, gpt-oss's experts): 32 FP4 e2m1 codes per block with one e8m0 exponent.
Read as transformers dequantizes it as it loads a checkpoint, or, read lazily by a tensor-parallel rank,
dequantized by the experts' loader (``layers/moe_weights.mxfp4``): both give float weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cb_serve.model_executor.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class Mxfp4Config(QuantizationConfig):
    name: ClassVar[str] = "mxfp4"
    reads_checkpoint: ClassVar[bool] = False  # transformers dequantizes it (or the experts' loader, under TP)
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, params: dict[str, Any]) -> Mxfp4Config:
        return cls(tuple(params.get("modules_to_not_convert") or ()))

    def weights(self, state: Mapping, dtype: torch.dtype) -> Mapping:
        return state  # its ``*_blocks`` / ``*_scales`` are read by the experts' loader

    def describe(self) -> str:
        return "MXFP4 experts, dequantized at load"
