"""``nn.Linear`` with CPU fast paths for the batch sizes the engine runs.

- **Decode-sized batches** (up to ``DECODE_MAX_ROWS`` rows): MKL's float32 GEMM spends much of its
  time on packing and blocking made for large batches, so ``Linear.prepare_for_cpu`` keeps a copy
  of the weight packed for ``cpu_ops.decode_gemm`` (tiles of 32 output columns, each one contiguous
  stream, the next tile prefetched while the current one computes).
- **Exactly low-bit weights** (dequantized GGUF Q4_1 / Q4_0 / Q4_K as 4 bits, Q8_0 / Q5_0 / Q6_K as 8,
  recognized by ``cpu_ops.exact_quant``) are kept low-bit and dequantized per tile into the same
  float32 values: a fraction of the memory traffic, the same results.
- **Larger batches of low-bit weights** run a split-bf16 kernel where ``cpu_ops.kernel_choice`` picks one:
  ``amx_gemm`` on AMX CPUs from ``AMX_MIN_ROWS`` rows up, ``bf16_gemm`` (AVX512-BF16) where it measured
  faster than the float32 GEMM; both float32-accurate from the same 4/8 bits, prefill-sized batches included.
- **Weights exact in bf16** (a bf16 checkpoint served in float32) are packed as bf16 for the experts' grouped
  GEMM with one group: decode rows on its FMA tiles (bit for bit ``decode_gemm`` on the float32 copy, half
  the bytes), larger batches on AMX tiles where ``kernel_choice`` picks AMX (float32-accurate).
- Anything else (prefill on other CPUs, GPUs) runs ``F.linear`` on the weight stored transposed.

The measured effect of each path is in ``bench/HISTORY.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant
from cb_serve.cpu_ops.kernel_choice import AMX_MIN_ROWS, kernel_choice
from cb_serve.model_executor import weight_cache
from cb_serve.model_executor.layers.fused_experts import CpuExpertGemm

__all__ = ["AMX_MIN_ROWS", "DECODE_MAX_ROWS", "Linear"]
DECODE_MAX_ROWS = 64  # above this MKL's GEMM is as fast or faster
SPLIT_KERNELS = {"amx": cpu_ops.amx_gemm, "avx512_bf16": cpu_ops.bf16_gemm}


class Linear(nn.Linear):
    decode_weight: torch.Tensor | None = None
    split_weight: torch.Tensor | None = None  # exact_quant.pack_amx_weight's layout, for split_kernel
    bf16_weight: torch.Tensor | None = None  # cpu_ops.pack_expert_weight's bf16 layout, one group
    split_kernel: str = "mkl"
    split_min_rows: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if self.bf16_weight is not None and 0 < rows and (rows <= DECODE_MAX_ROWS or self.split_kernel == "amx"):
            amx = self.split_kernel == "amx" and self.in_features % 32 == 0
            offsets = torch.tensor([0, rows])
            min_rows = CpuExpertGemm.AMX_MIN_ROWS if amx else None
            weight, n = self.bf16_weight, self.out_features
            return cpu_ops.grouped_gemm(x.contiguous(), offsets, weight, n, self.bias, min_rows)
        if self.split_weight is not None and rows >= self.split_min_rows:
            kernel = SPLIT_KERNELS[self.split_kernel]
            return kernel(x.contiguous(), self.split_weight, self.out_features, self.bias)
        if self.decode_weight is not None and 0 < rows <= DECODE_MAX_ROWS:
            return cpu_ops.decode_gemm(x.contiguous(), self.decode_weight, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)

    def bytes_read(self, rows: int) -> int:
        """Bytes of weight (and bias) that ``forward`` streams for a batch of ``rows`` rows."""
        if self.bf16_weight is not None and 0 < rows and (rows <= DECODE_MAX_ROWS or self.split_kernel == "amx"):
            weight = self.bf16_weight
        elif self.split_weight is not None and rows >= self.split_min_rows:
            weight = self.split_weight
        elif self.decode_weight is not None and 0 < rows <= DECODE_MAX_ROWS:
            weight = self.decode_weight
        else:
            weight = self.weight
        bias = 0 if self.bias is None else self.bias.nbytes
        return weight.nbytes + bias

    @torch.no_grad()
    def prepare_for_cpu(self, pack: bool, transpose: bool = True) -> None:
        """``pack``: add the packed copy for ``decode_gemm`` (float32 only): 4 or 8 bits per weight
        when the weight is exactly a dequantized GGUF one of the formats ``cpu_ops.exact_quant`` knows, else
        a second float32 copy; for such a low-bit weight, where ``kernel_choice()`` picks a split-bf16 kernel
        (and it takes the weight's groups: not Q6_K's scales per 16), also the layout it runs larger batches
        from. ``transpose``: store the weight transposed (still an ``[out, in]``
        parameter) so ``F.linear`` runs an NN GEMM, ~10% faster on CPU; leave it off for a weight
        shared with an embedding (row lookups want the plain layout)."""
        if transpose:
            self.weight.data = self.weight.data.t().contiguous().t()
        if pack and self.weight.dtype == torch.float32 and cpu_ops.available():
            groups = weight_cache.find_quant_groups(self.weight)  # exact_quant's, cached on disk
            if groups is not None:
                self.decode_weight = exact_quant.pack_decode_weight_quantized(groups)
                choice = kernel_choice()
                if choice is not None and choice.split in SPLIT_KERNELS:
                    self.split_weight = exact_quant.pack_amx_weight(groups)  # None: decode_gemm, then F.linear
                    self.split_kernel, self.split_min_rows = choice.split, choice.split_min_rows
            elif cpu_ops.exact_in_bf16(self.weight):
                self.bf16_weight = cpu_ops.pack_expert_weight(self.weight[None])
                choice = kernel_choice()
                self.split_kernel = "amx" if choice is not None and choice.split == "amx" else "mkl"
            else:
                self.decode_weight = cpu_ops.pack_decode_weight(self.weight)
