"""Fused Triton kernels of the decoder layer's elementwise parts on CUDA, in HF's op order: the residual add
with RMSNorm (one read of each row, the sum written back as the next residual), and the gated activation
``act(gate) * up`` of the MLP. Each replaces several PyTorch kernels per layer (an unfused RMSNorm is about
nine: casts, square, mean, add, rsqrt, two products), which matters most in a decode step's CUDA graph,
where the kernels' count, not their bytes, sets its time at small batches.

The same numbers as the PyTorch path up to float32 reduction order: the sum of squares is a tree here
and PyTorch's mean another, so the rare row whose normalized value sits on a rounding boundary of the
output dtype differs by one unit in the last place. Checked against the PyTorch reference under the
Triton interpreter on the CPU (``tests/kernels/test_fused_triton.py``). ``available()``: Triton imports and
CUDA is present; the layers call these only for CUDA tensors (``applies``).
"""

from __future__ import annotations

import functools

import torch

from cb_serve.attention.triton_kernels import rounded, tl, triton

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
MAX_ROW = 65536  # widest row one program normalizes in a single block


INTERPRETED_ON_CPU = False  # tests: the layers take these kernels for CPU tensors too (under TRITON_INTERPRET=1)


@functools.cache
def available() -> bool:
    """Triton imports and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


def applies(x: torch.Tensor) -> bool:
    """Whether a layer runs its fused kernel on ``x``: a CUDA tensor where Triton is available."""
    return (x.is_cuda and available()) or (INTERPRETED_ON_CPU and triton is not None and x.device.type == "cpu")


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x,
        residual,
        weight,
        out,
        stride_x,
        stride_r,
        stride_o,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        GEMMA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Row ``program_id``: with a residual, ``h = residual + x`` rounded to the input dtype and stored
        into ``residual``; then ``out = norm(h)``: Llama's ``w * (h / rms).to(dtype)``, or Gemma's
        ``(h / rms * (1 + w)).to(dtype)`` (the weight in float32 before the cast)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
        dtype = h.dtype
        if HAS_RESIDUAL:
            r = tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
            h = rounded(h.to(tl.float32) + r.to(tl.float32), dtype)
            tl.store(residual + row * stride_r + cols, h, mask=mask)
        hf = h.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
        w = tl.load(weight + cols, mask=mask, other=0.0)
        if GEMMA:
            y = rounded(hf * inv * (1.0 + w.to(tl.float32)), dtype)
        else:
            y = rounded(w.to(tl.float32) * rounded(hf * inv, dtype).to(tl.float32), w.dtype)
        tl.store(out + row * stride_o + cols, y.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _act_and_mul_kernel(x, out, stride_x, stride_o, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``program_id(0)``, columns block ``program_id(1)``: ``act(gate) * up`` with ``x = [gate | up]``;
        the activation rounded to the input dtype before the product, as the unfused ops round it."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x + row * stride_x + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        if ACT == 0:  # silu
            a = g / (1.0 + tl.exp(-g))
        else:  # gelu, tanh approximation: tanh(z) = 2 / (1 + e^-2z) - 1
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * z)))
        y = rounded(rounded(a, gate.dtype).to(tl.float32) * up.to(tl.float32), gate.dtype)
        tl.store(out + row * stride_o + cols, y, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows of its last dimension (a view where it can be), unit stride along the row."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """``norm(x)`` over the last dimension, in a new tensor of ``x``'s shape."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch_norm(rows, None, weight, out, eps, gemma)
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)``; ``residual`` (2-D, unit stride along rows) is updated in
    place, the normalized rows are a new tensor."""
    assert residual.dim() == 2 and residual.stride(-1) == 1 and x.shape == residual.shape
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch_norm(rows, residual, weight, out, eps, gemma)
    return out, residual


def _launch_norm(rows, residual, weight, out, eps: float, gemma: bool) -> None:
    n_rows, n_cols = rows.shape
    assert n_cols <= MAX_ROW and weight.numel() == n_cols
    if n_rows == 0:
        return
    has_residual = residual is not None
    res = residual if has_residual else rows
    _rms_norm_kernel[(n_rows,)](
        rows, res, weight, out, rows.stride(0), res.stride(0), out.stride(0), n_cols, eps,
        HAS_RESIDUAL=has_residual, GEMMA=gemma, BLOCK=triton.next_power_of_2(n_cols),
    )  # fmt: skip


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of ``x = [gate | up]`` along the last dimension (``activation``: an HF name in
    ``ACTIVATIONS``)."""
    rows = _rows(x)
    n_rows, width = rows.shape
    n_cols = width // 2
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows:
        block = min(1024, triton.next_power_of_2(n_cols))
        grid = (n_rows, triton.cdiv(n_cols, block))
        _act_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), n_cols, ACTIVATIONS[activation], block)
    return out.view(*x.shape[:-1], n_cols)
