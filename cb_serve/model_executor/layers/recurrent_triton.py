"""The decode step of the recurrent layers of hybrid models as Triton kernels (CUDA): the gated delta rule
(Gated DeltaNet), Mamba2's selective state update, and the depthwise causal conv of both.

Each kernel takes one token of each of ``N`` sequences and the layer's FULL state tensor
(``[num_slots, ...]``) with each sequence's slot id (``slots``, int32 ``[N]``): a program loads its
sequence's state tile from ``states[slots[i]]``, advances it one token in float32 registers, writes it back
in place and stores its share of the output (in the input's dtype). So the caller does no gather or
scatter, and the launch reads the slots on the device only (CUDA-graph capturable). A slot of -1 marks a
padding row (a CUDA graph's batch padded to its captured size): its programs exit at once, touching no
state and leaving that row of the output unwritten (uninitialized). Slots other than -1 must be distinct:
two rows with one slot would race on its state.

- ``fused_recurrent_gated_delta_rule``: one program per (sequence, value head, block of ``BLOCK_V`` value
  columns) holds the ``[Dk, BLOCK_V]`` state tile: decay, the ``S^T k`` read, the delta-rule write and the
  ``S^T q`` output in one pass, q and k L2-normalized in the kernel (GQA: value head ``h`` reads key head
  ``h // (Hv // Hk)``);
- ``selective_state_update``: one program per (sequence, head, block of ``BLOCK_P`` head-dim rows) holds
  the ``[BLOCK_P, S]`` state tile (head ``h`` reads group ``h // (H // G)``'s B and C);
- ``causal_conv1d_update``: one program per (sequence, block of ``BLOCK_C`` channels) holds the
  ``[BLOCK_C, K]`` window (the state's last ``K - 1`` inputs and the new one), which becomes the new state.

The semantics are the PyTorch references' (``delta_rule.recurrent_rule``, ``ssd.state_update``,
``causal_conv.causal_conv_step``), computed in float32 throughout. Dims need not be powers of two (masked).
Imports cleanly without Triton; ``is_available`` says whether it can run.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = tl = None


def is_available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _gated_delta_rule_kernel(
        q,
        k,
        v,
        g,
        beta,
        state,
        slots,
        out,
        Dk,
        Dv,
        group,
        scale,
        stride_qn,
        stride_qh,
        stride_qd,
        stride_kn,
        stride_kh,
        stride_kd,
        stride_vn,
        stride_vh,
        stride_vd,
        stride_gn,
        stride_gh,
        stride_bn,
        stride_bh,
        stride_ss,
        stride_sh,
        stride_sk,
        stride_sv,
        stride_on,
        stride_oh,
        stride_od,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Sequence ``program_id(0)``, value head ``program_id(1)``, value columns block ``program_id(2)``."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slots + n).to(tl.int64)
        if slot < 0:  # padding row
            return
        hk = h // group
        ks = tl.arange(0, BLOCK_K)
        cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        k_ok = ks < Dk
        v_ok = cols < Dv
        qv = tl.load(q + n * stride_qn + hk * stride_qh + ks * stride_qd, mask=k_ok, other=0.0).to(tl.float32)
        kv = tl.load(k + n * stride_kn + hk * stride_kh + ks * stride_kd, mask=k_ok, other=0.0).to(tl.float32)
        qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + 1e-6) * scale
        kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + 1e-6)
        vv = tl.load(v + n * stride_vn + h * stride_vh + cols * stride_vd, mask=v_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g + n * stride_gn + h * stride_gh).to(tl.float32))
        b = tl.load(beta + n * stride_bn + h * stride_bh).to(tl.float32)
        s_ptrs = state + slot * stride_ss + h * stride_sh + ks[:, None] * stride_sk + cols[None, :] * stride_sv
        mask = k_ok[:, None] & v_ok[None, :]
        s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32) * decay  # [BLOCK_K, BLOCK_V]
        kv_mem = tl.sum(s * kv[:, None], axis=0)
        delta = (vv - kv_mem) * b
        s = s + kv[:, None] * delta[None, :]
        o = tl.sum(s * qv[:, None], axis=0)
        tl.store(s_ptrs, s.to(state.dtype.element_ty), mask=mask)
        tl.store(out + n * stride_on + h * stride_oh + cols * stride_od, o.to(out.dtype.element_ty), mask=v_ok)

    @triton.jit
    def _selective_state_update_kernel(
        x,
        dt,
        a,
        b,
        c,
        d,
        dt_bias,
        state,
        slots,
        out,
        P,
        S,
        group,
        stride_xn,
        stride_xh,
        stride_xp,
        stride_dtn,
        stride_dth,
        stride_bn,
        stride_bg,
        stride_bs,
        stride_cn,
        stride_cg,
        stride_cs,
        stride_ss,
        stride_sh,
        stride_sp,
        stride_sn,
        stride_on,
        stride_oh,
        stride_op,
        BLOCK_P: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """Sequence ``program_id(0)``, head ``program_id(1)``, head-dim rows block ``program_id(2)``."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slots + n).to(tl.int64)
        if slot < 0:  # padding row
            return
        grp = h // group
        rows = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        ss = tl.arange(0, BLOCK_S)
        p_ok = rows < P
        s_ok = ss < S
        step = tl.load(dt + n * stride_dtn + h * stride_dth).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
        step = tl.where(step > 20.0, step, tl.log(1.0 + tl.exp(step)))  # softplus, torch's threshold 20
        d_a = tl.exp(step * tl.load(a + h).to(tl.float32))
        xv = tl.load(x + n * stride_xn + h * stride_xh + rows * stride_xp, mask=p_ok, other=0.0).to(tl.float32)
        bv = tl.load(b + n * stride_bn + grp * stride_bg + ss * stride_bs, mask=s_ok, other=0.0).to(tl.float32)
        cv = tl.load(c + n * stride_cn + grp * stride_cg + ss * stride_cs, mask=s_ok, other=0.0).to(tl.float32)
        s_ptrs = state + slot * stride_ss + h * stride_sh + rows[:, None] * stride_sp + ss[None, :] * stride_sn
        mask = p_ok[:, None] & s_ok[None, :]
        s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_S]
        s = s * d_a + (step * bv)[None, :] * xv[:, None]
        o = tl.sum(s * cv[None, :], axis=1) + tl.load(d + h).to(tl.float32) * xv
        tl.store(s_ptrs, s.to(state.dtype.element_ty), mask=mask)
        tl.store(out + n * stride_on + h * stride_oh + rows * stride_op, o.to(out.dtype.element_ty), mask=p_ok)

    @triton.jit
    def _causal_conv1d_update_kernel(
        x,
        state,
        weight,
        bias,
        slots,
        out,
        C,
        K,
        stride_xn,
        stride_xc,
        stride_ss,
        stride_sc,
        stride_sk,
        stride_wc,
        stride_wk,
        stride_on,
        stride_oc,
        HAS_BIAS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Sequence ``program_id(0)``, channels block ``program_id(1)``."""
        n = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + n).to(tl.int64)
        if slot < 0:  # padding row
            return
        chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        js = tl.arange(0, BLOCK_K)
        c_ok = chans < C
        s_base = state + slot * stride_ss + chans[:, None] * stride_sc
        # the window: the state's inputs 1..K-1, then the new input; it is also the new state
        older = tl.load(s_base + (js[None, :] + 1) * stride_sk, mask=c_ok[:, None] & (js[None, :] < K - 1), other=0.0)
        xv = tl.load(x + n * stride_xn + chans * stride_xc, mask=c_ok, other=0.0)
        window = tl.where(js[None, :] == K - 1, xv.to(tl.float32)[:, None], older.to(tl.float32))  # [BLOCK_C, BLOCK_K]
        mask = c_ok[:, None] & (js[None, :] < K)
        w = tl.load(weight + chans[:, None] * stride_wc + js[None, :] * stride_wk, mask=mask, other=0.0)
        acc = tl.sum(window * w.to(tl.float32), axis=1)
        if HAS_BIAS:
            acc += tl.load(bias + chans, mask=c_ok, other=0.0).to(tl.float32)
        acc = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(s_base + js[None, :] * stride_sk, window.to(state.dtype.element_ty), mask=mask)
        tl.store(out + n * stride_on + chans * stride_oc, acc.to(out.dtype.element_ty), mask=c_ok)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_slots(slots: torch.Tensor, n: int) -> None:
    assert slots.dtype == torch.int32 and slots.shape == (n,), (slots.dtype, slots.shape, n)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    block_v: int = 32,
) -> torch.Tensor:
    """One token of each of ``N`` sequences (``q``, ``k`` ``[N, Hk, Dk]``, ``v`` ``[N, Hv, Dv]``, ``g`` (log
    decay), ``beta`` ``[N, Hv]``) from and into ``ssm_states[slots]`` (``[num_slots, Hv, Dk, Dv]``, updated in
    place). Returns the outputs ``[N, Hv, Dv]`` in ``v``'s dtype."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    assert k.shape == q.shape and v.shape[0] == n and hv % hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == beta.shape == (n, hv) and ssm_states.shape[1:] == (hv, dk, dv), (g.shape, ssm_states.shape)
    _check_slots(slots, n)
    out = v.new_empty(n, hv, dv)
    if n == 0:
        return out
    block_v = min(block_v, _pow2(dv))
    _gated_delta_rule_kernel[(n, hv, triton.cdiv(dv, block_v))](
        q,
        k,
        v,
        g,
        beta,
        ssm_states,
        slots,
        out,
        dk,
        dv,
        hv // hk,
        dk**-0.5,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *g.stride(),
        *beta.stride(),
        *ssm_states.stride(),
        *out.stride(),
        BLOCK_K=_pow2(dk),
        BLOCK_V=block_v,
    )
    return out


def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    block_p: int = 32,
) -> torch.Tensor:
    """Mamba2's decode: one token of each of ``N`` sequences (``x`` ``[N, H, P]``, ``dt`` ``[N, H]`` before
    ``dt_bias`` and softplus, ``b``, ``c`` ``[N, G, S]``; ``a`` (``-exp(A_log)``), ``d``, ``dt_bias``
    ``[H]``, contiguous) from and into ``ssm_states[slots]`` (``[num_slots, H, P, S]``, updated in place).
    Returns the outputs ``[N, H, P]`` in ``x``'s dtype."""
    n, h, p = x.shape
    groups, s = b.shape[1:]
    assert dt.shape == (n, h) and b.shape == c.shape == (n, groups, s) and h % groups == 0, (dt.shape, b.shape)
    assert a.shape == d.shape == dt_bias.shape == (h,) and ssm_states.shape[1:] == (h, p, s), ssm_states.shape
    assert a.is_contiguous() and d.is_contiguous() and dt_bias.is_contiguous()
    _check_slots(slots, n)
    out = x.new_empty(n, h, p)
    if n == 0:
        return out
    block_p = min(block_p, _pow2(p))
    _selective_state_update_kernel[(n, h, triton.cdiv(p, block_p))](
        x,
        dt,
        a,
        b,
        c,
        d,
        dt_bias,
        ssm_states,
        slots,
        out,
        p,
        s,
        h // groups,
        *x.stride(),
        *dt.stride(),
        *b.stride(),
        *c.stride(),
        *ssm_states.stride(),
        *out.stride(),
        BLOCK_P=block_p,
        BLOCK_S=_pow2(s),
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    block_c: int = 128,
) -> torch.Tensor:
    """One token of each of ``N`` sequences (``x`` ``[N, C]``) through the depthwise causal conv (``weight``
    ``[C, K]``, ``bias`` ``[C]`` or None) and SiLU, from and into ``conv_states[slots]`` (``[num_slots, C,
    K]``: each sequence's last ``K`` inputs, updated in place). Returns the outputs ``[N, C]`` in ``x``'s
    dtype."""
    n, ch = x.shape
    width = weight.shape[1]
    assert weight.shape == (ch, width) and conv_states.shape[1:] == (ch, width), (weight.shape, conv_states.shape)
    assert bias is None or (bias.shape == (ch,) and bias.is_contiguous())
    _check_slots(slots, n)
    out = x.new_empty(n, ch)
    if n == 0:
        return out
    block_c = min(block_c, _pow2(ch))
    _causal_conv1d_update_kernel[(n, triton.cdiv(ch, block_c))](
        x,
        conv_states,
        weight,
        x if bias is None else bias,
        slots,
        out,
        ch,
        width,
        *x.stride(),
        *conv_states.stride(),
        *weight.stride(),
        *out.stride(),
        HAS_BIAS=bias is not None,
        BLOCK_C=block_c,
        BLOCK_K=_pow2(width),
    )
    return out
