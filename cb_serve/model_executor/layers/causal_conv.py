"""The depthwise causal convolution of recurrent layers (Gated DeltaNet, Mamba2), over one sequence's
chunk or one token of many sequences, continuing from each sequence's conv state: its last ``K``
inputs (zeros at the start, HF's zero left padding). Each follows HF transformers' PyTorch path
(``causal_conv1d_fn`` over the state and the chunk, ``causal_conv1d_update``) op for op; the
activation is SiLU, as every served model's ``hidden_act``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cb_serve.model_executor.layers import recurrent_triton


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's ``x`` ``[T, C]`` from ``state`` ``[C, K]``; ``weight`` ``[C, K]``, ``bias`` ``[C]``.
    Returns the outputs ``[T, C]`` (after SiLU) and the new state."""
    length, width = x.shape[0], weight.shape[1]
    full = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None], bias, padding=width - 1, groups=weight.shape[0])
    out = F.silu(out[0, :, : full.shape[1]][:, -length:]).to(x.dtype)
    return out.transpose(0, 1), full[:, -width:]


def causal_conv_step(
    x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``N`` sequences (``x`` ``[N, C]``, ``states`` ``[N, C, K]``). Returns the
    outputs ``[N, C]`` and the new states."""
    width = weight.shape[1]
    full = torch.cat([states, x[:, :, None]], dim=-1).to(weight.dtype)
    out = F.conv1d(full, weight[:, None], bias, padding=0, groups=weight.shape[0])[:, :, -1]
    return F.silu(out).to(x.dtype), full[:, :, -width:]


def conv_step(
    x: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``causal_conv_step`` on ``states[slots]`` (int64 ``[N]``), in place; returns the outputs. The Triton
    kernel on CUDA, else PyTorch."""
    if states.is_cuda and recurrent_triton.is_available():
        return recurrent_triton.causal_conv1d_update(x, states, weight, bias, slots.int())
    out, states[slots] = causal_conv_step(x, states[slots], weight, bias)
    return out
