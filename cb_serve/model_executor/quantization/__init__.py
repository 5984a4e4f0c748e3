"""Quantized checkpoints: ``quantization_config(hf_config)`` picks the ``QuantizationConfig`` of the
checkpoint's ``quant_method`` (``QUANTIZATION_METHODS``), or refuses one cb-serve cannot load, by name."""

from __future__ import annotations

from cb_serve.model_executor.quantization.awq import AWQConfig
from cb_serve.model_executor.quantization.base import QuantizationConfig, as_dict
from cb_serve.model_executor.quantization.compressed_tensors import CompressedTensorsConfig
from cb_serve.model_executor.quantization.fp8 import Fp8Config
from cb_serve.model_executor.quantization.gptq import GPTQConfig
from cb_serve.model_executor.quantization.mxfp4 import Mxfp4Config

__all__ = [
    "QUANTIZATION_METHODS",
    "AWQConfig",
    "CompressedTensorsConfig",
    "Fp8Config",
    "GPTQConfig",
    "Mxfp4Config",
    "QuantizationConfig",
    "quantization_config",
]

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "fp8": Fp8Config,
    "compressed-tensors": CompressedTensorsConfig,
    "mxfp4": Mxfp4Config,
    "gptq": GPTQConfig,
    "awq": AWQConfig,
}


def quantization_config(hf_config) -> QuantizationConfig | None:
    """The checkpoint's quantization (None: its weights are plain floats, or a GGUF file's, which transformers
    dequantizes as it reads them); ``ValueError`` naming the method when cb-serve cannot load it."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    params = as_dict(raw)
    method = params.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"This checkpoint is quantized with quant_method {method!r}, which cb-serve cannot load yet; "
            f"supported: {', '.join(QUANTIZATION_METHODS)}. Serve an unquantized (or GGUF) checkpoint instead."
        )
    return QUANTIZATION_METHODS[method].from_hf(params)
