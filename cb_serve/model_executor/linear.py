"""``nn.Linear`` with CPU fast paths for the batch sizes the engine runs.

- **Decode-sized batches** (up to ``DECODE_MAX_ROWS`` rows): MKL's float32 GEMM spends much of its
  time on packing and blocking made for large batches, so ``Linear.prepare_for_cpu`` keeps a copy
  of the weight packed for ``cpu_ops.decode_gemm`` (tiles of 32 output columns, each one contiguous
  stream, the next tile prefetched while the current one computes).
- **Exactly low-bit weights** (the default model's Q4_1 projections and Q8_0 LM head, recognized
  by ``cpu_ops.exact_quant``) are kept as 4 or 8 bits and dequantized per tile into the same
  float32 values: a fraction of the memory traffic, the same results.
- **AMX CPUs** run such low-bit weights on ``cpu_ops.amx_gemm`` from ``AMX_MIN_ROWS`` rows up
  (float32-accurate, from the same 4/8 bits), prefill-sized batches included.
- Anything else (prefill without AMX, GPUs) runs ``F.linear`` on the weight stored transposed.

The measured effect of each path is in ``bench/HISTORY.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant

DECODE_MAX_ROWS = 64  # above this MKL's GEMM is as fast or faster
AMX_MIN_ROWS = 13  # below this the tiles' fixed costs outweigh decode_gemm's (bench/micro_kernels.py gemm)


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
