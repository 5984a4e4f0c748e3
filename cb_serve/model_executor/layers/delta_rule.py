"""The gated delta rule of Gated DeltaNet layers (Qwen3.5, Qwen3-Next), in PyTorch: the reference every
kernel is checked against, and the path that runs where none applies.

A sequence's state ``S`` (``[Hv, Dk, Dv]``, float32) evolves per token ``t`` as
``S = exp(g_t) S``, ``S += k_t (beta_t (v_t - S^T k_t))^T``, and the token's output is ``S^T q_t``, with
q and k L2-normalized and q scaled by ``Dk^-1/2``. Two forms, each with HF transformers' operations in
HF's order (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``), so a sequence's
outputs are HF's to float32 rounding:

- ``chunk_rule``: one sequence's prefill chunk, in blocks of ``CHUNK`` tokens solved with a triangular
  system, continuing from its state (a chunked prefill continues exactly where the last chunk stopped);
- ``recurrent_rule``: one token per sequence (decode), any number of sequences at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cb_serve import cpu_ops
from cb_serve.model_executor.layers import recurrent_triton

CHUNK = 64  # HF's chunk size: tokens per block of the chunked form


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(g, beta)`` per token and value head: the log decay ``-exp(A_log) softplus(a + dt_bias)`` (float32)
    and the write strength ``sigmoid(b)`` (in ``b``'s dtype)."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def _prepare(q, k, v, beta, g):
    """HF's common prologue: key heads repeated to the value heads, float32, q and k L2-normalized."""
    ratio = v.shape[-2] // q.shape[-2]
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=-2), k.repeat_interleave(ratio, dim=-2)
    q, k, v, beta, g = (x.to(torch.float32) for x in (q, k, v, beta, g))
    return l2norm(q), l2norm(k), v, beta, g


def chunk_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's ``T`` tokens (``q``, ``k`` ``[T, Hk, Dk]``, ``v`` ``[T, Hv, Dv]``, ``g``, ``beta``
    ``[T, Hv]``) from ``state`` ``[Hv, Dk, Dv]``: (outputs ``[T, Hv, Dv]`` in ``v``'s dtype, the new state)."""
    dtype, length = v.dtype, v.shape[0]
    q, k, v, beta, g = _prepare(q, k, v, beta, g)
    q, k, v, beta, g = (x.transpose(0, 1) for x in (q, k, v, beta, g))  # [H, T, ...]
    q = q * (q.shape[-1] ** -0.5)
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    heads, chunks = q.shape[0], (length + pad) // CHUNK
    q, k, v_beta, k_beta = (x.reshape(heads, chunks, CHUNK, x.shape[-1]) for x in (q, k, v_beta, k_beta))
    cum = g.reshape(heads, chunks, CHUNK).cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    s = state.to(new_values)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, chunks * CHUNK, -1)[:, :length].transpose(0, 1)
    return out.to(dtype), s


def recurrent_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``N`` sequences (``q``, ``k`` ``[N, Hk, Dk]``, ``v`` ``[N, Hv, Dv]``, ``g``,
    ``beta`` ``[N, Hv]``) from their states ``[N, Hv, Dk, Dv]``: (outputs ``[N, Hv, Dv]``, the new states)."""
    dtype = v.dtype
    q, k, v, beta, g = _prepare(q, k, v, beta, g)
    q = q / (q.shape[-1] ** 0.5)
    s = state.to(v) * g.exp()[..., None, None]
    kv_mem = (s * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2).to(dtype), s


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    use_cpu_ops: bool = False,
) -> torch.Tensor:
    """``recurrent_rule`` on ``states[slots]`` (int64 ``[N]``), in place; returns the outputs. The C++ kernel
    where ``use_cpu_ops`` (float32: bit for bit this module's), the Triton kernel on CUDA, else PyTorch."""
    if use_cpu_ops and v.dtype == torch.float32:
        q, k = l2norm(q.float()), l2norm(k.float())
        return cpu_ops.gated_delta_rule_decode(states, q / (q.shape[-1] ** 0.5), k, v, g.exp(), beta.float(), slots)
    if states.is_cuda and recurrent_triton.is_available():
        return recurrent_triton.fused_recurrent_gated_delta_rule(q, k, v, g, beta, states, slots.int())
    out, states[slots] = recurrent_rule(q, k, v, g, beta, states[slots])
    return out
