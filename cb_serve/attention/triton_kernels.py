"""The Triton kernels of the paged-attention backend (``triton_backend.py`` launches them): the KV write,
the attention over a ragged batch (a program per query tile and KV head, its KV range optionally split
flash-decoding style) and the combine of the splits' partial softmax states. Defined only where Triton
imports (``triton`` is then the module, else None).
"""

from __future__ import annotations

import inspect

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = tl = rounded = None

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256

# What a step's batch changes never recompiles a kernel. Triton compiles a variant per specialization of
# its arguments (an integer ``== 1`` or ``% 16 == 0``, a pointer 16-byte aligned or not); warm-up and graph
# capture compile the ones start-up meets, and any other would compile live, for seconds, in the middle of
# serving. So integers that follow the batch (a block table's width, the KV splits) are not specialized,
# and neither is the alignment of the index arrays read one element at a time (a KV-cache group's block
# table or slot mapping is a view at an offset that follows the batch's size; no vector load gains from
# it). Alignment still specializes the tensors whose rows are loaded as vectors (q, the caches, out).
WRITE_KV_UNSPECIALIZED_ALIGNMENT = ("slot_mapping",)
ATTENTION_UNSPECIALIZED = ("num_splits", "stride_bt")
ATTENTION_UNSPECIALIZED_ALIGNMENT = ("block_table", "seqused_k", "cu_seqlens_q", "plan")
COMBINE_UNSPECIALIZED = ("num_splits",)
COMBINE_UNSPECIALIZED_ALIGNMENT = ("out", "part_m", "part_l", "part_acc")  # rows from the first prefill row on


def jit_options(ints: tuple[str, ...] = (), pointers: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """``triton.jit``'s keywords for arguments left unspecialized: ``ints`` on their value, ``pointers``
    on their alignment (``do_not_specialize_on_alignment``, Triton >= 3.2; before it, ``do_not_specialize``
    leaves a pointer's alignment out as well)."""
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        return {"do_not_specialize": ints, "do_not_specialize_on_alignment": pointers}
    return {"do_not_specialize": ints + pointers}


if triton is not None:

    @triton.jit
    def rounded(f, dtype: tl.constexpr):
        """float32 ``f`` in ``dtype``, rounded to nearest even as PyTorch rounds (to bfloat16 by hand: the
        interpreter's cast truncates; on the GPU the two agree)."""
        if dtype == tl.bfloat16:
            bits = f.to(tl.int32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
            return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
        return f.to(dtype)

    @triton.jit(**jit_options(pointers=WRITE_KV_UNSPECIALIZED_ALIGNMENT))
    def _write_kv_kernel(
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_ct,
        stride_ch,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        H_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        """Token ``program_id`` -> cache slot ``slot_mapping[t]`` (all KV heads); negative slots write nothing."""
        t = tl.program_id(0)
        slot = tl.load(slot_mapping + t).to(tl.int64)
        offs_h = tl.arange(0, H_PAD)[:, None]
        offs_d = tl.arange(0, D_PAD)[None, :]
        mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM) & (offs_d * 0 + slot >= 0)  # no scalar masks: interpreter
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_h * stride_ch + offs_d
        tl.store(k_cache + dst, tl.load(k + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask), mask=mask)
        tl.store(v_cache + dst, tl.load(v + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask), mask=mask)

    @triton.jit
    def _attend_tile(
        acc,
        l_i,
        m_i,
        q,
        k_cache,
        v_cache,
        bt_row,
        j,
        seq_len,
        q_pos,
        window,
        qk_scale,
        softcap,
        stride_cb,
        stride_ct,
        offs_d,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        MASKED: tl.constexpr,
        PAD_D: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One online-softmax step over keys ``j * BLOCK_N ...``; ``MASKED`` applies causal/window/length masks."""
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASKED:
            blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < seq_len, other=0)
        else:
            blk = tl.load(bt_row + offs_n // BLOCK_SIZE)
        ptrs = (blk.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct)[:, None] + offs_d[None, :]
        if MASKED or PAD_D:
            kv_ok = (offs_n < seq_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
            k = tl.load(k_cache + ptrs, mask=kv_ok, other=0.0)
            v = tl.load(v_cache + ptrs, mask=kv_ok, other=0.0)
        else:
            k = tl.load(k_cache + ptrs)
            v = tl.load(v_cache + ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:  # cap * tanh(s / cap) (both in log2 units), tanh(y) = 1 - 2 / (e^2y + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / softcap)) + 1.0))
        if MASKED:
            ok = offs_n[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                ok = ok & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    # Over 60 lines: one fused program per tile (its 40 parameters alone take 45); more @triton.jit
    # helpers would only move lines, and each split makes the compiler's inlining harder to check.
    @triton.jit(**jit_options(ATTENTION_UNSPECIALIZED, ATTENTION_UNSPECIALIZED_ALIGNMENT))
    def _paged_attention_kernel(
        out,
        q,
        k_cache,
        v_cache,
        block_table,
        seqused_k,
        cu_seqlens_q,
        plan,
        part_m,
        part_l,
        part_acc,
        sinks,
        qk_scale,
        softcap,
        window,
        num_splits,
        num_heads,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_bt,
        stride_cb,
        stride_ct,
        stride_ch,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        IS_DECODE: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        PAD_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Grid ``(kv_heads, tiles, splits)``. Decode: tile = row = sequence. Else ``plan[tile]`` holds
        (sequence, query offset) of a tile of up to ``BLOCK_Q`` tokens."""
        kvh = tl.program_id(0)
        tile = tl.program_id(1)
        split = tl.program_id(2)
        if IS_DECODE:
            seq = tile
            q_off = 0
            q_len = 1
            tok0 = tile
        else:
            seq = tl.load(plan + 2 * tile)
            q_off = tl.load(plan + 2 * tile + 1)
            q_start = tl.load(cu_seqlens_q + seq)
            q_len = tl.load(cu_seqlens_q + seq + 1) - q_start
            tok0 = q_start + q_off
        seq_len = tl.load(seqused_k + seq)
        ctx = seq_len - q_len  # cached tokens = position of the sequence's first query token

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        r_tok = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (r_tok < BLOCK_Q) & (q_off + r_tok < q_len)
        rd_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        q_pos = ctx + q_off + r_tok
        qt = tl.load(
            q + (tok0 + r_tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=rd_ok, other=0.0
        )

        # Key blocks [j_lo, j_hi) split into masked [j_lo, j_a), unmasked [j_a, j_b), masked [j_b, j_hi).
        p_lo = ctx + q_off
        if IS_DECODE:
            p_hi = p_lo
        else:
            p_hi = ctx + tl.minimum(q_off + BLOCK_Q, q_len) - 1
        j_hi = (p_hi + BLOCK_N) // BLOCK_N
        if HAS_WINDOW:
            j_lo = tl.maximum(p_lo - window + 1, 0) // BLOCK_N
            j_a = (tl.maximum(p_hi - window + 1, 0) + BLOCK_N - 1) // BLOCK_N
        else:
            j_lo = p_lo * 0
            j_a = j_lo
        j_a = tl.minimum(tl.maximum(j_a, j_lo), j_hi)
        j_b = tl.minimum(tl.maximum((p_lo + 1) // BLOCK_N, j_a), j_hi)
        if SPLIT:
            per = (j_hi - j_lo + num_splits - 1) // num_splits
            s_lo = j_lo + split * per
            s_hi = tl.minimum(s_lo + per, j_hi)
        else:
            s_lo = j_lo
            s_hi = j_hi

        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
        if HAS_SINKS:  # the sink column (no value), counted once: in split 0
            first = (offs_m * 0 + split) == 0
            m_i = tl.where(first, tl.load(sinks + head).to(tl.float32) * 1.4426950408889634, m_i)
            l_i = tl.where(first, 1.0, l_i)
        bt_row = block_table + seq * stride_bt
        k_base = k_cache + kvh * stride_ch
        v_base = v_cache + kvh * stride_ch
        for j in range(tl.maximum(j_lo, s_lo), tl.minimum(j_a, s_hi)):
            acc, l_i, m_i = _attend_tile(
                acc,
                l_i,
                m_i,
                qt,
                k_base,
                v_base,
                bt_row,
                j,
                seq_len,
                q_pos,
                window,
                qk_scale,
                softcap,
                stride_cb,
                stride_ct,
                offs_d,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_SIZE,
                True,
                PAD_D,
                HAS_WINDOW,
                HAS_SOFTCAP,
                DOT_PRECISION,
            )
        for j in range(tl.maximum(j_a, s_lo), tl.minimum(j_b, s_hi)):
            acc, l_i, m_i = _attend_tile(
                acc,
                l_i,
                m_i,
                qt,
                k_base,
                v_base,
                bt_row,
                j,
                seq_len,
                q_pos,
                window,
                qk_scale,
                softcap,
                stride_cb,
                stride_ct,
                offs_d,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_SIZE,
                False,
                PAD_D,
                HAS_WINDOW,
                HAS_SOFTCAP,
                DOT_PRECISION,
            )
        for j in range(tl.maximum(j_b, s_lo), s_hi):
            acc, l_i, m_i = _attend_tile(
                acc,
                l_i,
                m_i,
                qt,
                k_base,
                v_base,
                bt_row,
                j,
                seq_len,
                q_pos,
                window,
                qk_scale,
                softcap,
                stride_cb,
                stride_ct,
                offs_d,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_SIZE,
                True,
                PAD_D,
                HAS_WINDOW,
                HAS_SOFTCAP,
                DOT_PRECISION,
            )

        if SPLIT:  # unnormalized partial state, combined by _combine_splits_kernel
            part = ((tok0 + r_tok) * num_heads + head) * num_splits + split
            tl.store(part_m + part, m_i, mask=row_ok)
            tl.store(part_l + part, l_i, mask=row_ok)
            tl.store(part_acc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=rd_ok)
        else:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows without keys (padding): zeros
            o_ptrs = out + (tok0 + r_tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=rd_ok)

    @triton.jit(**jit_options(COMBINE_UNSPECIALIZED, COMBINE_UNSPECIALIZED_ALIGNMENT))
    def _combine_splits_kernel(
        out,
        part_m,
        part_l,
        part_acc,
        num_splits,
        num_heads,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
    ):
        """Grid ``(rows, heads)``: merges the ``num_splits`` partial softmax states of one row and head."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D_PAD)
        s_ok = offs_s < num_splits
        part = (t * num_heads + h) * num_splits + offs_s
        m = tl.load(part_m + part, mask=s_ok, other=float("-inf"))
        l_s = tl.load(part_l + part, mask=s_ok, other=0.0)
        d_ok = offs_d < HEAD_DIM
        acc = tl.load(
            part_acc + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )
        w = tl.exp2(m - tl.max(m, 0))
        denom = tl.sum(w * l_s, 0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
        tl.store(out + t * stride_ot + h * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=d_ok)
