"""``nn.Linear`` with a CPU fast path for decode-sized batches.

At decode batch sizes (a few to ~64 rows) MKL's fp32 GEMM spends much of its time on packing and
blocking made for large batches. With the C++ kernels, ``Linear.prepare_for_cpu`` keeps a copy of the weight packed for
``cpu_ops.decode_gemm`` (tiles of 32 output columns, each one contiguous stream); larger batches
(prefill) run MKL's NN GEMM on the weight stored transposed. Measured on the default model's
shapes, all 30 layers plus the LM head with weights streamed from memory: 34 rows 52.7 -> 45.4 ms
(MKL with pre-packed weights) and 56 ms (plain MKL); 8 rows 33.6 -> 24.7 ms; 64 rows even. Prefetching
the next weight tile while the current one is in use then took 34 rows to 38.9 ms and 64 rows to ~60 ms.
Weights that are exactly 4- or 8-bit (the default model's Q4_1 projections, Q8_0 LM head) are kept so and
dequantized per tile into the same float32 values: 4 rows 26 -> 14 ms, 8 rows 30 -> 16 ms, 34 rows 40.5 ->
37 ms. On an AMX CPU those low-bit weights run batches of ``AMX_MIN_ROWS`` or more on ``cpu_ops.amx_gemm``
(float32-accurate, from the same 4/8 bits): 16 rows 23.6 -> 16.9 ms, 34 rows 35.4 -> 30.0 ms, 64 rows 59.8 ->
35.8 ms, and prefill-sized batches at 1.2-1.8x MKL's float32 rate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant

DECODE_MAX_ROWS = 64  # above this MKL's GEMM is as fast or faster
AMX_MIN_ROWS = 13  # amx_gemm: 12 rows 16.9 ms vs 19.4, 8 rows 16.8 vs 16.0, 1 row 15.9 vs 12.6 (all layers)


class Linear(nn.Linear):
    decode_weight: torch.Tensor | None = None
    amx_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if self.amx_weight is not None and rows >= AMX_MIN_ROWS:
            return cpu_ops.amx_gemm(x.contiguous(), self.amx_weight, self.out_features, self.bias)
        if self.decode_weight is not None and 0 < rows <= DECODE_MAX_ROWS:
            return cpu_ops.decode_gemm(x.contiguous(), self.decode_weight, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def prepare_for_cpu(self, pack: bool, transpose: bool = True) -> None:
        """``pack``: add the packed copy for ``decode_gemm`` (float32 only): 4 or 8 bits per weight
        when the weight is exactly a dequantized GGUF Q4_1 / Q4_0 / Q8_0 one (``cpu_ops.exact_quant``), else
        a second float32 copy; for such a low-bit weight on an AMX CPU, also the layout ``amx_gemm`` runs
        batches of ``AMX_MIN_ROWS`` and more from. ``transpose``: store the weight transposed (still an ``[out, in]``
        parameter) so ``F.linear`` runs an NN GEMM, ~10% faster on CPU; leave it off for a weight
        shared with an embedding (row lookups want the plain layout)."""
        if transpose:
            self.weight.data = self.weight.data.t().contiguous().t()
        if pack and self.weight.dtype == torch.float32 and cpu_ops.available():
            groups = exact_quant.find_quant_groups(self.weight)
            if groups is not None:
                self.decode_weight = exact_quant.pack_decode_weight_quantized(groups)
                if cpu_ops.amx_available():
                    self.amx_weight = exact_quant.pack_amx_weight(groups)
            else:
                self.decode_weight = cpu_ops.pack_decode_weight(self.weight)
