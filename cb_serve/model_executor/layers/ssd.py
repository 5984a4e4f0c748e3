"""Mamba2's selective state-space scan (SSD), in PyTorch: the reference every kernel is checked against,
and the path that runs where none applies.

Per head ``h`` a sequence's state ``S`` (``[P, N]``: head dim by state dim, float32) evolves per token as
``S = exp(dt A) S + dt x B^T`` and the token's output is ``S C + D x``, with ``dt = softplus(dt_raw +
dt_bias)`` and the groups' ``B``, ``C`` shared by their heads. Two forms, each with HF transformers'
operations in HF's order (``mamba2_chunk_scan`` / ``mamba2_selective_state_update`` of
``modeling_granitemoehybrid``), so a sequence's outputs are HF's to float32 rounding:

- ``chunk_scan``: one sequence's prefill chunk, in blocks of ``chunk_size`` tokens, continuing from its
  state (a chunked prefill continues exactly where the last chunk stopped);
- ``state_update``: one token per sequence (decode), any number of sequences at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cb_serve import cpu_ops
from cb_serve.model_executor.layers import recurrent_triton


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., L]`` -> ``[..., L, L]``: entry ``(i, j)`` the sum of ``x[j+1..i]`` (-inf above the diagonal)."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    x = x.masked_fill(~torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    sums = torch.cumsum(x, dim=-2)
    return sums.masked_fill(~torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device)), -torch.inf)


def _chunks(x: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """``[1, T, ...]`` zero-padded by ``pad`` tokens and cut into ``[1, chunks, chunk_size, ...]``."""
    x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, 0, 0, 0, 0, pad))
    return x.reshape(1, -1, chunk_size, *x.shape[2:])


def chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's ``T`` tokens: ``x`` ``[T, H, P]``, ``dt`` ``[T, H]`` (before ``dt_bias`` and softplus),
    ``a`` ``[H]`` (``-exp(A_log)``), ``b``, ``c`` ``[T, G, N]``, ``d`` ``[H]``, from ``state`` ``[H, P, N]``.
    Returns (outputs ``[T, H, P]`` float32, the new state)."""
    length, heads = x.shape[0], x.shape[1]
    dt = torch.clamp(F.softplus(dt + dt_bias.to(dt.dtype)), min=dt_limit[0], max=dt_limit[1])[None]
    x = x.float()[None]
    b = b.float().repeat_interleave(heads // b.shape[1], dim=1, output_size=heads)[None]
    c = c.float().repeat_interleave(heads // c.shape[1], dim=1, output_size=heads)[None]
    pad = (chunk_size - length % chunk_size) % chunk_size
    d_residual = d[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    a = a.to(x.dtype) * dt.float()
    x, a, b, c = (_chunks(t, pad, chunk_size) for t in (x, a, b, c))
    a = a.permute(0, 3, 1, 2)
    a_cumsum = torch.cumsum(a, dim=-1)
    # within each chunk: an attention-like product masked by the decays between positions
    decay = torch.exp(_segment_sum(a))
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    # each chunk's own contribution to the state at its end, then the states carried across chunks
    b_decay = b * torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum).permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", b_decay, x)
    states = torch.cat([state[None, None].to(states), states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    # the carried-in state's contribution to each position
    y_off = torch.einsum("bclhn,bchpn->bclhp", c, states) * torch.exp(a_cumsum).permute(0, 2, 3, 1)[..., None]
    out = (y_diag + y_off).contiguous().reshape(1, -1, heads, x.shape[-1]) + d_residual
    return out[0, :length], final[0]


def state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``N`` sequences: ``x`` ``[N, H, P]``, ``dt`` ``[N, H]``, ``b``, ``c`` ``[N, G, S]``,
    from ``states`` ``[N, H, P, S]``. Returns (outputs ``[N, H, P]`` in ``x``'s dtype, the new states)."""
    n, heads, head_dim = x.shape
    groups, size = b.shape[1], b.shape[2]
    dt = F.softplus(dt[..., None].expand(-1, -1, head_dim) + dt_bias[:, None].expand(-1, head_dim).to(dt.dtype))
    dt = dt[..., None]
    d_a = torch.exp(dt.float() * a[:, None, None].expand(-1, head_dim, size).float())
    b = b.reshape(n, groups, 1, size).expand(n, groups, heads // groups, size).contiguous().reshape(n, heads, 1, size)
    new = states * d_a + (dt * b) * x[..., None]
    c = c.reshape(n, groups, 1, size).expand(n, groups, heads // groups, size).contiguous().reshape(n, heads, size)
    out = torch.bmm(new.to(c.dtype).view(n * heads, head_dim, size), c.view(n * heads, size, 1))
    out = out.view(n, heads, head_dim)
    out = (out + x * d[:, None].expand(-1, head_dim)).to(out.dtype)
    return out.to(x.dtype), new


def state_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    use_cpu_ops: bool = False,
) -> torch.Tensor:
    """``state_update`` on ``states[slots]`` (int64 ``[N]``), in place; returns the outputs. The C++ kernel
    where ``use_cpu_ops`` (float32: the state bit for bit, the output's sum over the state dim in order where
    torch's ``bmm`` picks its own), the Triton kernel on CUDA, else PyTorch."""
    if use_cpu_ops and x.dtype == torch.float32:
        step = _vectorized(F.softplus, dt + dt_bias.to(dt.dtype)).float()
        decay = _vectorized(torch.exp, step * a.float())
        return cpu_ops.mamba2_decode(states, x, step, decay, b, c, d.float(), slots)
    if states.is_cuda and recurrent_triton.is_available():
        return recurrent_triton.selective_state_update(x, dt, a, b, c, d, dt_bias, states, slots.int())
    out, states[slots] = state_update(x, dt, a, b, c, d, dt_bias, states[slots])
    return out


def _vectorized(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` with every element on torch's vectorized path (padded to whole vectors): where ``state_update``
    computes it per head dim (``[N, H, P]``, ``[N, H, P, S]``: whole vectors), the same bits per head."""
    flat = x.reshape(-1)
    return fn(F.pad(flat, (0, -flat.numel() % 64)))[: flat.numel()].view(x.shape)
