"""flash-attn backend (CUDA). Imports cleanly without flash-attn; ``is_available`` says."""

from __future__ import annotations

import torch

from cb_serve.attention.base import AttentionBackend, AttentionMetadata

try:  # pragma: no cover - exercised only where flash-attn is installed
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # pragma: no cover
    flash_attn_varlen_func = flash_attn_with_kvcache = None


def is_available() -> bool:
    return flash_attn_varlen_func is not None and torch.cuda.is_available()


class FlashAttentionBackend(AttentionBackend):  # pragma: no cover - needs CUDA + flash-attn
    """Decode-only steps through ``flash_attn_with_kvcache``; mixed steps through
    ``flash_attn_varlen_func`` over the paged cache (``block_table``)."""

    name = "flash_attn"
    block_size_multiple = 256  # FA2's paged KV requires it

    def __init__(self) -> None:
        if not is_available():
            raise RuntimeError("flash-attn backend needs CUDA and the flash_attn package (pip install cb-serve[gpu]).")

    def forward(
        self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None = None
    ) -> torch.Tensor:
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        if meta.max_seqlen_q == 1:
            out = flash_attn_with_kvcache(
                q.unsqueeze(1),
                kv_cache[0],
                kv_cache[1],
                cache_seqlens=meta.seqused_k,
                block_table=meta.block_table,
                softmax_scale=scale,
                causal=True,
                window_size=window,
            )
            return out.squeeze(1)
        return flash_attn_varlen_func(
            q,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=meta.block_table,
        )
