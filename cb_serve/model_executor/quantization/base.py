"""``QuantizationConfig``: what a checkpoint's ``quantization_config`` says about how its weights are stored
(vLLM's name), one class per ``quant_method``. A method knows which tensors belong to a quantized weight
(scales beside it) and turns them into the values the layers load (``weights``); a method cb-serve does not
know, or a config that contradicts its checkpoint (missing scales, scales of the wrong shape), is a clear
error at load, never a silent cast."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from cb_serve.model_executor.layers.activation_quant import ActivationScheme


class QuantizationConfig(ABC):
    """One checkpoint's quantization, from its ``quantization_config`` dict."""

    name: ClassVar[str]  # the ``quant_method`` it reads
    # its weights are read from a local checkpoint's files by cb-serve (else as transformers loads them)
    reads_checkpoint: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def from_hf(cls, params: dict[str, Any]) -> QuantizationConfig:
        """From the ``quantization_config`` dict; raises ``ValueError`` for fields it cannot honour."""

    @abstractmethod
    def weights(self, state: Mapping, dtype: torch.dtype) -> Mapping:
        """The checkpoint's tensors (a state dict or a ``LazyCheckpoint``) as the layers read them, quantized
        weights as ``dtype`` values."""

    @property
    def activations(self) -> ActivationScheme | None:
        """How the checkpoint quantizes each quantized layer's input (W8A8), or None: weight-only."""
        return None

    @property
    def activation_refusal(self) -> str | None:
        """Why the checkpoint's input quantization cannot be applied (with ``activation_quantization="on"``), or
        None; without it the weights alone still load."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """One line for the start-up log."""


def as_dict(params: Any) -> dict[str, Any]:
    """A ``quantization_config`` as a dict: the raw one of ``config.json``, or transformers' object for it."""
    if isinstance(params, Mapping):
        return dict(params)
    if hasattr(params, "to_dict"):
        return dict(params.to_dict())
    raise ValueError(f"quantization_config must be a mapping, not {type(params).__name__}")
