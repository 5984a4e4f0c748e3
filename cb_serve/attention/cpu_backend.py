"""The CPU backend: the PyTorch backend with decode rows and prefill chunks through C++ paged-attention
kernels that read K/V blocks in place instead of gathering them (``cb_serve/cpu_ops``)."""

from __future__ import annotations

from cb_serve import cpu_ops
from cb_serve.attention.base import AttentionMetadata, to_cache_dtype
from cb_serve.attention.torch_backend import NO_EXTRAS, Extras, TorchAttentionBackend


def is_available() -> bool:
    return cpu_ops.available()


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
        if meta.bidirectional_spans:  # image tokens attending both ways: the PyTorch path's mask
            return super().prefill(out, q, k, v, kv_cache, meta, scale, sliding_window, extra)
        args = (meta.cu_seqlens_q, meta.seqused_k, meta.block_table, meta.num_decodes, scale, sliding_window)
        if not cpu_ops.paged_prefill_attention(out, q, kv_cache[0], kv_cache[1], *args, extra.softcap, extra.sinks):
            super().prefill(out, q, k, v, kv_cache, meta, scale, sliding_window, extra)
