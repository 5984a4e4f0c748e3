"""The linear-method seam (vLLM's ``LinearMethodBase``): how a ``Linear`` keeps and multiplies its weight.
Methods: ``linear.UnquantizedLinearMethod`` (float weights), ``low_bit_linear.ExactLowBitLinearMethod``
(exactly-low-bit GGUF weights kept packed)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(ABC):
    """How a ``Linear``'s weight is kept after loading and multiplied (vLLM's ``LinearMethodBase``; typed
    ``nn.Linear`` here: ``linear.Linear``, which imports this module). A method
    keeps no state of its own: what it derives from the weight (packed copies) lives on the layer."""

    @abstractmethod
    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight^T + bias`` as ``layer`` keeps its weight."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Linear, pack: bool, transpose: bool) -> None:
        """Derive the layouts ``apply`` reads from the loaded weight (``pack``: the CPU kernels' copies;
        ``transpose``: the weight stored transposed for plain NN GEMMs)."""

    def bytes_read(self, layer: nn.Linear, rows: int) -> int:
        """Bytes of weight (and bias) that ``apply`` streams for a batch of ``rows`` rows."""
        bias = 0 if layer.bias is None else layer.bias.nbytes
        return layer.weight.nbytes + bias
