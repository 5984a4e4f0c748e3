"""Exactly-low-bit weights kept low-bit only: a dequantized GGUF projection without its float32 copy.

A weight that ``cpu_ops.exact_quant`` finds to be 4- or 8-bit groups (GGUF Q4_0/Q4_1/Q4_K, Q5_0, Q8_0, Q6_K
dequantized by transformers at load) is multiplied from its packed groups at every batch size, so the
float32 copy (4 bytes a weight, against 0.75-1.25) is dropped once they are packed:

- up to ``DECODE_MAX_ROWS`` rows, and larger batches where no split-bf16 kernel runs: ``decode_gemm``,
  which dequantizes each tile in registers or in cache (its rows in chunks of ``CHUNK_ROWS``, each row the
  same FMA chain whatever the batch);
- from ``split_min_rows`` rows where ``cpu_ops.kernel_choice`` picks a split-bf16 kernel (``amx_gemm``,
  ``bf16_gemm``) and the groups suit it: that kernel, from its own layout of the same groups.

An embedding tied to such a head reads its rows from the same packing (``exact_quant.decode_weight_rows``).
Groups of a permutation of the inputs (GPTQ's activation order sorted into runs of one group,
``QuantGroups.perm``) are multiplied by the input columns in that order (``PERMUTED_LOW_BIT``): the same
products, summed in another order.
"""

from __future__ import annotations

import torch
from torch import nn

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant
from cb_serve.cpu_ops.kernel_choice import kernel_choice
from cb_serve.model_executor.layers.linear_method import LinearMethod

SPLIT_KERNELS = {"amx": cpu_ops.amx_gemm, "avx512_bf16": cpu_ops.bf16_gemm}
CHUNK_ROWS = 256  # decode_gemm's rows per call above decode sizes: their activations stay in L2


def keep_low_bit(layer: nn.Linear, groups: exact_quant.QuantGroups) -> None:
    """Packs ``groups`` (``layer``'s weight, bit for bit) for ``decode_gemm`` and, where ``kernel_choice()``
    picks a split-bf16 kernel that takes them (not Q6_K's scales per 16), for it; then drops the float32
    weight (an empty tensor of its dtype: nothing reads it again) and hands ``layer`` to
    ``ExactLowBitLinearMethod``."""
    layer.decode_weight = exact_quant.pack_decode_weight_quantized(groups)
    choice = kernel_choice()
    if choice is not None and choice.split in SPLIT_KERNELS:
        layer.split_weight = exact_quant.pack_amx_weight(groups)  # None: decode_gemm at every size
        layer.split_kernel, layer.split_min_rows = choice.split, choice.split_min_rows
    layer.weight.data = layer.weight.data.new_empty(0)
    layer.input_perm = groups.perm
    layer.method = EXACT_LOW_BIT if groups.perm is None else PERMUTED_LOW_BIT


def weight_rows(layer: nn.Linear, rows: torch.Tensor) -> torch.Tensor:
    """float32 rows ``rows`` of ``layer``'s weight, from its low-bit packing (``keep_low_bit``)."""
    return exact_quant.decode_weight_rows(layer.decode_weight, rows)


class ExactLowBitLinearMethod(LinearMethod):
    """``x @ weight^T + bias`` from the packed groups ``keep_low_bit`` left (a ``LinearMethod``; the
    weights were processed when the layer was handed to it)."""

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.device.type == "cpu", "low-bit weights take float32 on the CPU"
        shape, n = x.shape, layer.out_features
        x = x.reshape(-1, shape[-1]).contiguous()
        rows = x.shape[0]
        if layer.split_weight is not None and rows >= layer.split_min_rows:
            out = SPLIT_KERNELS[layer.split_kernel](x, layer.split_weight, n, layer.bias)
        elif rows <= CHUNK_ROWS:
            out = cpu_ops.decode_gemm(x, layer.decode_weight, n, layer.bias)
        else:
            out = x.new_empty(rows, n)
            for start in range(0, rows, CHUNK_ROWS):
                part = x[start : start + CHUNK_ROWS]
                out[start : start + len(part)] = cpu_ops.decode_gemm(part, layer.decode_weight, n, layer.bias)
        return out.view(*shape[:-1], n)

    def process_weights_after_loading(self, layer: nn.Linear, pack: bool, transpose: bool) -> None:
        """Nothing left to do: ``keep_low_bit`` packed the weight."""

    def bytes_read(self, layer: nn.Linear, rows: int) -> int:
        split = layer.split_weight is not None and rows >= layer.split_min_rows
        weight = layer.split_weight if split else layer.decode_weight
        return weight.nbytes + (0 if layer.bias is None else layer.bias.nbytes)


class PermutedLowBitLinearMethod(ExactLowBitLinearMethod):
    """Groups of ``weight[:, input_perm]``: ``x[:, input_perm]`` times them. (Not ``EXACT_LOW_BIT``: a greedy head
    or a tied embedding, which read the packing in the weight's own order, do not take it.)"""

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return super().apply(layer, x.index_select(-1, layer.input_perm))


EXACT_LOW_BIT = ExactLowBitLinearMethod()
PERMUTED_LOW_BIT = PermutedLowBitLinearMethod()
