"""The CPU backend: the PyTorch backend with decode rows and prefill chunks through C++ paged-attention
kernels that read K/V blocks in place instead of gathering them (``cb_serve/cpu_ops``)."""

from __future__ import annotations

import torch

from cb_serve import cpu_ops
from cb_serve.attention.base import AttentionMetadata, to_cache_dtype
from cb_serve.attention.torch_backend import NO_EXTRAS, Extras, TorchAttentionBackend


def is_available() -> bool:
    return cpu_ops.available()


def bidirectional_reach(meta: AttentionMetadata) -> torch.Tensor:
    """int32 ``[T]``: each query row's last visible key position: its own (causal), or inside an image that
    attends both ways (``meta.bidirectional_spans``) the image's last, as ``torch_backend.causal_mask``."""
    reach = torch.zeros(int(meta.cu_seqlens_q[-1]), dtype=torch.int32)
    for i in range(meta.num_decodes, meta.num_seqs):
        start, q_len, k_len = int(meta.cu_seqlens_q[i]), meta.query_lens[i], meta.seq_lens[i]
        positions = torch.arange(k_len - q_len, k_len, dtype=torch.int32)
        for lo, hi in meta.bidirectional_spans.get(i, ()):
            positions[(positions >= lo) & (positions < hi)] = hi - 1
        reach[start : start + q_len] = positions
    return reach


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    supports_fused_cpu_ops = True

    @staticmethod
    def write_kv(k, v, kv_cache, slot_mapping) -> None:
        dtype = kv_cache.dtype
        cpu_ops.write_kv(to_cache_dtype(k, dtype), to_cache_dtype(v, dtype), kv_cache[0], kv_cache[1], slot_mapping)

    def decode(
        self,
        out,
        q,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        extra: Extras = NO_EXTRAS,
    ) -> None:
        n = meta.num_decodes
        args = (meta.block_table[:n], meta.seqused_k[:n], scale, sliding_window, extra.softcap, extra.sinks)
        cpu_ops.paged_decode_attention(out[:n], q[:n], kv_cache[0], kv_cache[1], *args)

    def prefill(
        self,
        out,
        q,
        k,
        v,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        extra: Extras = NO_EXTRAS,
    ) -> None:
        reach = None
        if meta.bidirectional_spans:  # image tokens attending both ways (one plan per step, for every layer)
            if (reach := meta.backend_cache.get("reach")) is None:
                reach = meta.backend_cache["reach"] = bidirectional_reach(meta)
        args = (meta.cu_seqlens_q, meta.seqused_k, meta.block_table, meta.num_decodes, scale, sliding_window)
        kernel_args = (extra.softcap, extra.sinks, reach)
        if not cpu_ops.paged_prefill_attention(out, q, kv_cache[0], kv_cache[1], *args, *kernel_args):
            super().prefill(out, q, k, v, kv_cache, meta, scale, sliding_window, extra)
