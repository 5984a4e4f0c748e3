"""``nn.Linear`` behind a linear-method seam (``linear_method.LinearMethod``, vLLM's ``LinearMethodBase``): a
``Linear`` holds its weight, a method decides how it is kept after loading and multiplied.
``UnquantizedLinearMethod`` (float weights) has CPU fast paths for the batch sizes the engine runs:

- **Decode-sized batches** (up to ``DECODE_MAX_ROWS`` rows): MKL's float32 GEMM spends much of its
  time on packing and blocking made for large batches, so ``Linear.prepare_for_cpu`` keeps a copy
  of the weight packed for ``cpu_ops.decode_gemm`` (tiles of 32 output columns, each one contiguous
  stream, the next tile prefetched while the current one computes).
- **Exactly low-bit weights** (dequantized GGUF Q4_1 / Q4_0 / Q4_K as 4 bits, Q8_0 / Q5_0 / Q6_K as 8,
  recognized by ``cpu_ops.exact_quant``) are handed to ``low_bit_linear.ExactLowBitLinearMethod``: kept
  low-bit only (the float32 copy dropped), ``decode_gemm`` or a split-bf16 kernel at every batch size, the
  same float32 values.
- **Weights exact in bf16** (a bf16 checkpoint served in float32) are packed as bf16 for the experts' grouped
  GEMM with one group: decode rows on its FMA tiles (bit for bit ``decode_gemm`` on the float32 copy, half
  the bytes), larger batches on AMX tiles where ``kernel_choice`` picks AMX (float32-accurate).
- Anything else (prefill on other CPUs, GPUs) runs ``F.linear`` on the weight stored transposed.

The measured effect of each path is in ``bench/HISTORY.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant
from cb_serve.cpu_ops.kernel_choice import AMX_MIN_ROWS, kernel_choice
from cb_serve.model_executor.layers.activation_quant import ActivationQuant
from cb_serve.model_executor.layers.fused_experts import CpuExpertGemm
from cb_serve.model_executor.layers.linear_method import LinearMethod
from cb_serve.model_executor.layers.low_bit_linear import keep_low_bit

__all__ = ["AMX_MIN_ROWS", "DECODE_MAX_ROWS", "Linear", "LinearMethod", "UnquantizedLinearMethod"]
DECODE_MAX_ROWS = 64  # above this MKL's GEMM is as fast or faster
QuantGroupFinder = Callable[[torch.Tensor], "exact_quant.QuantGroups | None"]
_FIND_QUANT_GROUPS: contextvars.ContextVar[QuantGroupFinder] = contextvars.ContextVar(
    "cb_serve_find_quant_groups", default=exact_quant.find_quant_groups
)


@contextlib.contextmanager
def quant_groups_from(finder: QuantGroupFinder) -> Iterator[None]:
    """Within it, ``prepare_for_cpu`` asks ``finder`` for a weight's exact low-bit groups (the loader's disk
    cache, ``weight_cache.find_quant_groups``) instead of ``exact_quant.find_quant_groups``."""
    token = _FIND_QUANT_GROUPS.set(finder)
    try:
        yield
    finally:
        _FIND_QUANT_GROUPS.reset(token)


def find_quant_groups(weight: torch.Tensor) -> exact_quant.QuantGroups | None:
    """``weight``'s exact low-bit groups, from the finder in effect (``quant_groups_from``)."""
    return _FIND_QUANT_GROUPS.get()(weight)


def checkpoint_groups(weight: torch.Tensor) -> exact_quant.QuantGroups | None:
    """The low-bit groups (INT4, FP8 codes) the checkpoint's parts gave ``weight`` as it loaded
    (``checkpoint.copy_parts``), if they still give it bit for bit (a model may have changed the weight since);
    taken off the weight either way."""
    groups = getattr(weight, "quant_groups", None)
    if groups is not None:
        del weight.quant_groups
        if list(groups.q.shape) == list(weight.shape) and torch.equal(groups.dequantize(), weight.detach()):
            return groups
    return None


class UnquantizedLinearMethod(LinearMethod):
    """Float weights: ``F.linear``, and on CPU the packed copies ``process_weights_after_loading`` adds for
    decode-sized batches and weights exact in bf16 (the module docstring)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if layer.bf16_weight is not None and 0 < rows and (rows <= DECODE_MAX_ROWS or layer.split_kernel == "amx"):
            amx = layer.split_kernel == "amx" and layer.in_features % 32 == 0
            offsets = torch.tensor([0, rows])
            min_rows = CpuExpertGemm.AMX_MIN_ROWS if amx else None
            weight, n = layer.bf16_weight, layer.out_features
            return cpu_ops.grouped_gemm(x.contiguous(), offsets, weight, n, layer.bias, min_rows)
        if layer.decode_weight is not None and 0 < rows <= DECODE_MAX_ROWS:
            return cpu_ops.decode_gemm(x.contiguous(), layer.decode_weight, layer.out_features, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def bytes_read(self, layer: Linear, rows: int) -> int:
        if layer.bf16_weight is not None and 0 < rows and (rows <= DECODE_MAX_ROWS or layer.split_kernel == "amx"):
            weight = layer.bf16_weight
        elif layer.decode_weight is not None and 0 < rows <= DECODE_MAX_ROWS:
            weight = layer.decode_weight
        else:
            weight = layer.weight
        bias = 0 if layer.bias is None else layer.bias.nbytes
        return weight.nbytes + bias

    def process_weights_after_loading(self, layer: Linear, pack: bool, transpose: bool) -> None:
        """``pack`` (float32 only): a weight that is exactly a dequantized GGUF one of the formats
        ``cpu_ops.exact_quant`` knows goes to ``low_bit_linear.keep_low_bit`` (kept as its 4 or 8 bits only);
        a weight exact in bf16 is packed as bf16; any other gets a second float32 copy for ``decode_gemm``.
        ``transpose``: store the weight transposed (still an ``[out, in]`` parameter) so ``F.linear`` runs an
        NN GEMM, ~10% faster on CPU; left off for a weight shared with an embedding (row lookups want the
        plain layout)."""
        pack = pack and layer.weight.dtype == torch.float32 and cpu_ops.available()
        if pack and (groups := checkpoint_groups(layer.weight) or find_quant_groups(layer.weight)) is not None:
            keep_low_bit(layer, groups)  # the float32 weight dropped: low_bit_linear's method from now on
            return
        if transpose:
            layer.weight.data = layer.weight.data.t().contiguous().t()
        if pack:
            if cpu_ops.exact_in_bf16(layer.weight):
                layer.bf16_weight = cpu_ops.pack_expert_weight(layer.weight[None], fp4=False)
                choice = kernel_choice()
                layer.split_kernel = "amx" if choice is not None and choice.split == "amx" else "mkl"
            else:
                layer.decode_weight = cpu_ops.pack_decode_weight(layer.weight)


UNQUANTIZED = UnquantizedLinearMethod()


class Linear(nn.Linear):
    """A linear layer whose ``method`` keeps and multiplies its weight (``UnquantizedLinearMethod`` by
    default); the packed copies a method derives live here, beside the weight. ``input_quant``: a W8A8
    checkpoint's quantization of the input, applied first (``take_input_quant``)."""

    decode_weight: torch.Tensor | None = None
    split_weight: torch.Tensor | None = None  # exact_quant.pack_amx_weight's layout, for split_kernel (low-bit)
    bf16_weight: torch.Tensor | None = None  # cpu_ops.pack_expert_weight's bf16 layout, one group
    split_kernel: str = "mkl"
    split_min_rows: int = 0
    input_perm: torch.Tensor | None = None  # low-bit groups of weight[:, input_perm] (low_bit_linear)
    input_quant: ActivationQuant | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, method: LinearMethod | None = None):
        super().__init__(in_features, out_features, bias)
        self.method = method or UNQUANTIZED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant is not None:
            x = self.input_quant(x)
        return self.method.apply(self, x)

    def take_input_quant(self, apply: bool) -> ActivationQuant | None:
        """The input quantization the checkpoint's parts gave the weight (``checkpoint.copy_parts``), taken off
        it, and kept as this layer's where ``apply``."""
        quant = getattr(self.weight, "input_quant", None)
        if quant is not None:
            del self.weight.input_quant
        self.input_quant = quant if apply else None
        return quant

    def bytes_read(self, rows: int) -> int:
        """Bytes of weight (and bias) that ``forward`` streams for a batch of ``rows`` rows."""
        return self.method.bytes_read(self, rows)

    @torch.no_grad()
    def prepare_for_cpu(self, pack: bool, transpose: bool = True) -> None:
        """The method's layouts after loading (``LinearMethod.process_weights_after_loading``)."""
        self.method.process_weights_after_loading(self, pack, transpose)
