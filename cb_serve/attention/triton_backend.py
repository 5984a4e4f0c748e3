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

from cb_serve.attention import triton_kernels as kernels
from cb_serve.attention import triton_rope_kv
from cb_serve.attention.base import AttentionBackend, AttentionMetadata, host_to_device


def is_available() -> bool:
    return kernels.triton is not None and torch.cuda.is_available()


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


class TritonAttentionBackend(AttentionBackend):
    """Triton KV write plus paged attention (see the module docstring). ``num_splits`` fixes how many
    programs share one tile's KV range (1: never split); by default it follows the grid's occupancy,
    up to ``max_splits``."""

    name = "triton"
    block_size_multiple = 16
    supports_cuda_graphs = True
    supports_fused_rope_kv = True

    def rope_and_write_kv(self, q, k, v, cos, sin, kv_cache, slot_mapping) -> torch.Tensor:
        return triton_rope_kv.rope_and_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping)

    def __init__(self, num_splits: int | None = None, max_splits: int = 16) -> None:
        if kernels.triton is None:
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
        if head_dim > kernels.MAX_HEAD_DIM or kv_cache.shape[-1] != head_dim or num_heads % num_kv_heads:
            raise ValueError(f"triton attention: unsupported head_dim {head_dim} or {num_heads}/{num_kv_heads} heads.")
        if k is not None:  # None: a KV-shared layer, whose K/V an earlier layer wrote
            self.write_kv(k, v, kv_cache, meta.slot_mapping)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        extra = (softcap * kernels.LOG2E if softcap else None, None if sinks is None else sinks.float())
        args = (kv_cache, meta, scale * kernels.LOG2E, sliding_window, *extra)
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
        kernels._paged_attention_kernel[(num_kv_heads, num_tiles, splits)](
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
        kernels._combine_splits_kernel[(out.shape[0] - first_row, num_heads)](
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
        kernels._write_kv_kernel[(k.shape[0],)](
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
