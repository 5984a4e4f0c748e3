"""The recurrent layers' decode kernels' Python side (``csrc/recurrent_ops.cpp``): one step of each
sequence, in place on the state tensor's slots. Loaded with the other kernels (``cpu_ops.available()``)."""

from __future__ import annotations

import torch

# Floats per vector of the sum kernel torch runs on CPU (its AVX2 build, also where AVX-512 is available: torch
# registers no AVX-512 sum), whose column grouping the delta rule's sums follow to add in torch's order.
SUM_VECTOR_WIDTH = 8


def gated_delta_rule_decode(
    states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """``states[slots]`` ``[N, Hv, Dk, Dv]`` stepped by one token (q, k ``[N, Hk, Dk]`` normalized, q scaled; v
    ``[N, Hv, Dv]``; ``decay`` = exp(g), ``beta`` ``[N, Hv]``, all float32); returns the outputs ``[N, Hv, Dv]``."""
    out = torch.empty_like(v)
    torch.ops.cb_serve.gated_delta_rule_decode(
        states,
        out,
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        decay.contiguous(),
        beta.contiguous(),
        slots,
        SUM_VECTOR_WIDTH,
    )
    return out


def mamba2_decode(
    states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    da: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """``states[slots]`` ``[N, H, P, S]`` stepped by one token (x ``[N, H, P]``; ``dt`` after softplus, ``da`` =
    exp(dt A) ``[N, H]``; b, c ``[N, G, S]``; d ``[H]``; float32); returns the outputs ``[N, H, P]``."""
    out = torch.empty_like(x)
    torch.ops.cb_serve.mamba2_decode(
        states, out, x.contiguous(), dt.contiguous(), da.contiguous(), b.contiguous(), c.contiguous(), d, slots
    )
    return out
