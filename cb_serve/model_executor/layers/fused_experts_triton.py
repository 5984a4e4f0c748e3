"""The grouped expert GEMM as one Triton kernel (CUDA), shaped like vLLM's ``fused_moe`` kernel.

The rows are already sorted by expert (``route_pairs``), so instead of a sorted token-id list a small
per-row-block table says which expert each block of ``BLOCK_M`` rows belongs to and where it starts:
each expert's row range is cut into blocks of its own, the last one short (masked), so no block straddles
two experts and nothing in the data is padded. The table is built on the device with torch ops from
``offsets`` (no host sync); its length is a bound that depends on shapes alone, ``P // BLOCK_M +
min(E, P)``, and its unused entries (expert -1) exit at once. So the launch is CUDA-graph capturable.

Each program computes one ``BLOCK_M x BLOCK_N`` output tile: ``x`` rows of its block times ``weight[e]``'s
columns, accumulated in float32 over ``K`` (``tf32x3`` for float32 inputs), plus ``bias[e]``, stored in the
output dtype. Imports cleanly without Triton; ``is_available`` says whether it can run.
"""

from __future__ import annotations

import torch

from cb_serve.model_executor.layers.fused_experts import ExpertGemm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = tl = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        x,
        w,
        bias,
        out,
        offsets,
        block_expert,
        block_start,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_we,
        stride_wn,
        stride_wk,
        stride_be,
        stride_bn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Tile (row block ``program_id(0)``, column block ``program_id(1)``) of ``out``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert + pid_m)
        if e < 0:  # past the last expert's last block
            return
        start = tl.load(block_start + pid_m)
        end = tl.load(offsets + e + 1)
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < end
        col_ok = cols < N
        x_ptrs = x + rows[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w + e * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(bias + e * stride_be + cols * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out + rows[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def block_table(offsets: torch.Tensor, block_m: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert, first row)`` of each block of up to ``block_m`` rows, experts in order, each expert's rows
    ``offsets[e]:offsets[e + 1]`` cut into blocks of its own; ``num_rows // block_m + min(E, num_rows)``
    entries (a bound on the blocks needed), the unused ones expert -1. Torch ops only: no host sync."""
    num_experts = offsets.numel() - 1
    offsets = offsets.to(torch.int64)
    blocks = (offsets.diff() + block_m - 1) // block_m  # per expert
    ends = blocks.cumsum(0)
    index = torch.arange(num_rows // block_m + min(num_experts, num_rows), device=offsets.device)
    expert = torch.searchsorted(ends, index, right=True)
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    start = offsets[e] + (index - ends[e] + blocks[e]) * block_m
    return torch.where(used, e, -1), start


class TritonExpertGemm(ExpertGemm):
    """``out[rows of e] = x[rows of e] @ weight[e]^T (+ bias[e])`` in one launch over (row block, column
    block) tiles; weights read in place (``[E, N, K]``, any strides). float32, float16 and bfloat16."""

    name = "triton"

    def __init__(self, block_n: int = 64) -> None:
        if triton is None:
            raise RuntimeError("TritonExpertGemm needs the triton package.")
        self.block_n = block_n

    def block_m(self, num_rows: int, num_experts: int) -> int:
        """Rows per tile: about the mean rows per expert, 16 (``tl.dot``'s least) to 64; shapes only."""
        return min(64, max(16, _pow2(-(-num_rows // max(num_experts, 1)))))

    def __call__(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        weight: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_rows, k = x.shape
        if x.dtype not in DTYPES or weight.dtype != x.dtype:
            raise ValueError(
                f"TritonExpertGemm supports fp32/fp16/bf16 x and weight of one dtype, got {x.dtype} and {weight.dtype}."
            )
        assert weight.shape[1:] == (n, k), (weight.shape, n, k)
        out = x.new_empty(num_rows, n) if out is None else out
        if num_rows == 0 or n == 0:  # K == 0 needs nothing special: the K loop runs no step
            return out
        block_m = self.block_m(num_rows, weight.shape[0])
        expert, start = block_table(offsets, block_m, num_rows)
        block_k = 32 if x.dtype == torch.float32 else 64
        block_k = min(block_k, max(16, _pow2(k)))
        grid = (expert.numel(), triton.cdiv(n, self.block_n))
        _grouped_gemm_kernel[grid](
            x,
            weight,
            x if bias is None else bias,
            out,
            offsets,
            expert,
            start,
            n,
            k,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            weight.stride(2),
            0 if bias is None else bias.stride(0),
            0 if bias is None else bias.stride(1),
            out.stride(0),
            HAS_BIAS=bias is not None,
            DOT_PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m,
            BLOCK_N=self.block_n,
            BLOCK_K=block_k,
        )
        return out
