"""Triton backend (CUDA): one paged-attention kernel for the whole ragged batch, reading K/V in place
through ``block_table``. Imports cleanly without Triton; ``is_available`` says whether it can run.

Each program owns one query tile of one sequence for one KV head: the tile's query tokens times the
``num_heads // num_kv_heads`` query heads sharing that KV head form the M rows of the dot products (a
decode row gives ``group`` rows, padded to 16). Decode rows are their own tiles, so decode-only steps
launch a grid that depends only on tensor shapes (CUDA-graph capturable), reading their KV length from
the device-side ``seqused_k``; mixed steps add a launch over prefill tiles listed by a per-step plan.
A tile's KV range may be split over several programs (flash-decoding) whose partial softmax states a
second kernel combines. Optional, as constexpr branches: scores soft-capped (``cap * tanh(s / cap)``), and
a per-head sink logit that starts the online softmax of the first split (max = sink, sum = 1).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from cb_serve.attention.base import AttentionBackend, AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = tl = None

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256


def is_available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
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
    @triton.jit
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

    @triton.jit
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


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def build_tile_plan(query_lens: np.ndarray, seq_lens: np.ndarray, first_seq: int, block_q: int) -> np.ndarray:
    """int32 ``[tiles, 2]`` of (sequence index, query offset): sequence ``first_seq + i`` cut into tiles of
    ``block_q`` query tokens, ordered by decreasing KV length so the longest tiles start first."""
    q_lens = np.asarray(query_lens, dtype=np.int64)
    n_tiles = -(-q_lens // block_q)
    seq = np.repeat(np.arange(len(q_lens)), n_tiles)
    q_off = (np.arange(len(seq)) - np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)) * block_q
    kv_len = np.asarray(seq_lens, dtype=np.int64)[seq] - q_lens[seq] + np.minimum(q_off + block_q, q_lens[seq])
    order = np.argsort(-kv_len, kind="stable")
    return np.stack([seq[order] + first_seq, q_off[order]], axis=1).astype(np.int32)


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``. A CUDA copy goes from pinned memory, so ``non_blocking`` really is
    (from pageable memory the host waits for it); PyTorch's pinned-memory allocator keeps the
    block until the copy is done, so the host tensor may go at once. Elsewhere a plain copy."""
    host = torch.from_numpy(array)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class TritonAttentionBackend(AttentionBackend):
    """Triton KV write plus paged attention (see the module docstring). ``num_splits`` fixes how many
    programs share one tile's KV range (1: never split); by default it follows the grid's occupancy,
    up to ``max_splits``."""

    name = "triton"
    block_size_multiple = 16
    supports_cuda_graphs = True

    def __init__(self, num_splits: int | None = None, max_splits: int = 16) -> None:
        if triton is None:
            raise RuntimeError("The triton attention backend needs the triton package.")
        self.num_splits = num_splits
        self.max_splits = max_splits

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = kv_cache.shape[-2]
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or kv_cache.dtype != q.dtype:
            raise ValueError(f"triton attention supports fp32/fp16/bf16 q and cache of one dtype, got {q.dtype}.")
        if head_dim > _MAX_HEAD_DIM or kv_cache.shape[-1] != head_dim or num_heads % num_kv_heads:
            raise ValueError(f"triton attention: unsupported head_dim {head_dim} or {num_heads}/{num_kv_heads} heads.")
        if k is not None:  # None: a KV-shared layer, whose K/V an earlier layer wrote
            self.write_kv(k, v, kv_cache, meta.slot_mapping)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        extra = (softcap * _LOG2E if softcap else None, None if sinks is None else sinks.float())
        args = (kv_cache, meta, scale * _LOG2E, sliding_window, *extra)
        if meta.max_seqlen_q == 1:  # decode only: grid and arguments depend on shapes alone (graph capturable)
            self._launch(out, q, *args)
            return out
        num_decodes = meta.num_decodes
        if num_decodes:
            self._launch(out[:num_decodes], q[:num_decodes], *args)
        group = num_heads // num_kv_heads
        block_m = max(16, _pow2(min(meta.max_seqlen_q * group, 128 if head_dim <= 128 else 64)), _pow2(group))
        if q.dtype == torch.float32:
            block_m = min(block_m, max(64, _pow2(group)))
        key = ("triton_plan", block_m // group)
        if key not in meta.backend_cache:
            q_lens, seq_lens = np.asarray(meta.query_lens[num_decodes:]), np.asarray(meta.seq_lens[num_decodes:])
            plan = build_tile_plan(q_lens, seq_lens, num_decodes, block_m // group)
            meta.backend_cache[key] = host_to_device(plan, q.device)
        self._launch(out, q, *args, plan=meta.backend_cache[key], block_m=block_m, first_row=num_decodes)
        return out

    def _launch(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        qk_scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        plan: torch.Tensor | None = None,
        block_m: int = 16,
        first_row: int = 0,
    ) -> None:
        """Decode rows ``0 .. q.shape[0]`` (``plan`` None: tile = row, nothing read from the host) or the
        prefill tiles of ``plan`` (rows ``first_row ..``); KV split over ``splits`` programs when that fills the GPU.
        The kernel's arguments in its signature's order (positional, then constexpr)."""
        num_heads, head_dim = q.shape[1:]
        num_kv_heads, block_size = kv_cache.shape[-2], kv_cache.shape[2]
        group, d_pad, is_decode = num_heads // num_kv_heads, max(16, _pow2(head_dim)), plan is None
        if is_decode:
            num_tiles, block_m = q.shape[0], max(16, _pow2(group))
            max_kv = meta.block_table.shape[1] * block_size  # a shape, not the step's lengths
        else:
            num_tiles = plan.shape[0]
            max_kv = meta.max_seqlen_k
        small = d_pad <= 128 and q.dtype != torch.float32  # else halve the K/V tiles to fit shared memory
        block_n = 64 if small else 32
        splits = self._num_splits(q.device, num_tiles * num_kv_heads, max_kv // (4 * block_n))
        part_m = part_l = part_acc = out
        if splits > 1:
            part_m = torch.empty((q.shape[0], num_heads, splits), dtype=torch.float32, device=q.device)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty((*part_m.shape, head_dim), dtype=torch.float32, device=q.device)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _paged_attention_kernel[(num_kv_heads, num_tiles, splits)](
            out, q, k_cache, v_cache, meta.block_table, meta.seqused_k, meta.cu_seqlens_q,
            meta.seqused_k if plan is None else plan, part_m, part_l, part_acc, out if sinks is None else sinks,
            qk_scale, softcap or 1.0, sliding_window or 0, splits, num_heads,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            meta.block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_Q=1 if is_decode else block_m // group,
            BLOCK_N=block_n, BLOCK_SIZE=block_size, IS_DECODE=is_decode, SPLIT=splits > 1,
            HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
            PAD_D=d_pad != head_dim,
            DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
            num_warps=8 if block_m >= 128 else 4, num_stages=3 if small else 2,
        )  # fmt: skip
        if splits > 1:
            self._combine_splits(out, part_m, part_l, part_acc, first_row, d_pad)

    def _num_splits(self, device: torch.device, num_programs: int, most: int) -> int:
        """KV splits per tile: enough programs for two waves over the SMs, at most ``most``."""
        if self.num_splits is not None:
            return max(1, self.num_splits)
        want = -(-2 * _num_sms(device) // max(num_programs, 1))
        return max(1, min(_pow2(want), self.max_splits, most))

    @staticmethod
    def _combine_splits(out, part_m, part_l, part_acc, first_row: int, d_pad: int) -> None:
        """Merges the per-split partial softmax results of rows ``first_row ..`` into ``out``."""
        rows = slice(first_row, None)
        num_heads, splits, head_dim = part_acc.shape[1:]
        _combine_splits_kernel[(out.shape[0] - first_row, num_heads)](
            out[rows],
            part_m[rows],
            part_l[rows],
            part_acc[rows],
            splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            S_PAD=_pow2(splits),
            num_warps=1,
        )

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Token ``t``'s K/V into slot ``slot_mapping[t]`` of the paged cache; a negative slot writes nothing."""
        if k.shape[0] == 0:
            return
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _write_kv_kernel[(k.shape[0],)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            H_PAD=_pow2(num_kv_heads),
            D_PAD=_pow2(head_dim),
            BLOCK_SIZE=kv_cache.shape[2],
            num_warps=1,
        )
