"""RMSNorm in HF's op order (float32 statistics, the weight applied in the input's dtype)."""

from __future__ import annotations

import torch
from torch import nn

from cb_serve import cpu_ops
from cb_serve.model_executor.layers import fused_triton


class RMSNorm(nn.Module):
    """``norm(x)``, or with a residual ``(norm(residual + x), residual + x)`` (vLLM's fused form).
    Normalizes the last dimension: a hidden state ``[T, hidden]``, or each head of ``[T, heads,
    head_dim]`` (q/k norms; the C++ kernel serves the 2-D hidden state only)."""

    def __init__(self, hidden_size: int, eps: float, use_cpu_ops: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_cpu_ops = use_cpu_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if fused_triton.applies(x) and type(self)._norm is RMSNorm._norm:  # not a subclass's own
            return self._fused_triton(x, residual, gemma=False)
        kernel = self.use_cpu_ops and x.dim() == 2
        if residual is None:
            return cpu_ops.rms_norm(x, self.weight, self.eps) if kernel else self._norm(x)
        if kernel:
            cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self._norm(residual), residual

    def _fused_triton(self, x: torch.Tensor, residual: torch.Tensor | None, gemma: bool):
        """One Triton kernel (``fused_triton``), the residual's add included; a 3-D ``x`` with a residual
        is not a hidden state and takes the PyTorch ops."""
        if residual is None:
            return fused_triton.rms_norm(x, self.weight, self.eps, gemma)
        if x.dim() == 2 and residual.is_contiguous():
            return fused_triton.fused_add_rms_norm(x, residual, self.weight, self.eps, gemma)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one and applied in float32 before
    the cast back (``(x * (1 + w)).to(dtype)``; Llama casts first). With ``use_cpu_ops``, float32 on
    the CPU runs Llama's C++ kernel with the weight ``1 + w``: the same float32 products, in the other
    order (they commute); hidden states ``[T, hidden]`` and q/k heads ``[T, heads, head_dim]`` alike.
    Other dtypes take the PyTorch ops (HF applies the weight before the cast, the kernel after)."""

    def __init__(self, hidden_size: int, eps: float, use_cpu_ops: bool = False) -> None:
        super().__init__(hidden_size, eps, use_cpu_ops)
        self._one_plus_weight: torch.Tensor | None = None
        self._one_plus_key: tuple[int, int, int] | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if fused_triton.applies(x) and type(self)._norm is GemmaRMSNorm._norm:
            return self._fused_triton(x, residual, gemma=True)
        if not (self.use_cpu_ops and x.dtype == torch.float32 and x.device.type == "cpu"):
            if residual is None:
                return self._norm(x)
            residual = residual + x
            return self._norm(residual), residual
        weight = self.one_plus_weight()
        if residual is None:  # q/k heads as rows of head_dim (a copy where the heads are strided)
            return cpu_ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, self.eps).view(x.shape)
        if x.dim() != 2:
            residual = residual + x
            return self.forward(residual), residual
        cpu_ops.fused_add_rms_norm(x, residual, weight, self.eps)
        return x, residual

    def one_plus_weight(self) -> torch.Tensor:
        """``1 + w`` in float32, as HF computes it; made again whenever the weight changes (the loader
        copies the checkpoint into it in place after construction)."""
        w = self.weight
        key = None if w.is_inference() else (id(w), w.data_ptr(), w._version)  # no version counter
        if self._one_plus_weight is None or key is None or key != self._one_plus_key:
            with torch.no_grad():
                self._one_plus_weight = (1.0 + w.float()).contiguous()
            self._one_plus_key = key
        return self._one_plus_weight

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Gemma4RMSNorm(RMSNorm):
    """Gemma 4's RMSNorm: ``x * (mean(x²) + eps) ** -0.5`` in float32 (``torch.pow``, as HF), times
    the weight itself (no ``1 +``), then cast back. PyTorch ops only."""

    def __init__(self, hidden_size: int, eps: float, use_cpu_ops: bool = False) -> None:
        super().__init__(hidden_size, eps, use_cpu_ops=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (y * self.weight.float()).type_as(x)


class Gemma4UnscaledRMSNorm(Gemma4RMSNorm):
    """Gemma 4's RMSNorm without a weight (``with_scale=False``: its v-norm)."""

    def __init__(self, hidden_size: int, eps: float, use_cpu_ops: bool = False) -> None:
        nn.Module.__init__(self)
        self.eps, self.use_cpu_ops = eps, False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).type_as(x)


class Float32WeightRMSNorm(RMSNorm):
    """The weight applied in float32 before the cast back (gpt-oss: ``(w * norm(x.float())).to(dtype)``;
    Llama casts first). In float32 the two orders are the same products, so float32 keeps Llama's path
    (the C++ kernel where it runs); other dtypes take PyTorch ops in gpt-oss's order."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)
