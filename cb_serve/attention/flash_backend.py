"""flash-attn backend (CUDA), opt-in (``attention_backend="flash_attn"``). Imports cleanly without
flash-attn; ``is_available`` says."""

from __future__ import annotations

import torch

from cb_serve.attention import triton_backend
from cb_serve.attention.base import AttentionBackend, AttentionMetadata

try:  # pragma: no cover - exercised only where flash-attn is installed
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # pragma: no cover
    flash_attn_varlen_func = flash_attn_with_kvcache = None


# flash-attn's setup.py imports torch (so pip must not isolate the build) and then downloads the
# release's prebuilt wheel named after the installed torch and CUDA (``+cu12torch2.Xcxx11abi...``);
# where none matches, it compiles its CUDA sources, which takes hours.
INSTALL_ADVICE = (
    "pip install flash-attn --no-build-isolation (a prebuilt wheel exists only for the torch and CUDA "
    "versions flash-attn's release lists, torch 2.4-2.8 with CUDA 12 for 2.8.3; elsewhere this is a "
    "source build of hours). The default attention_backend, triton, needs no extra package."
)


SINKS_UNSUPPORTED = (
    "attention_backend='flash_attn' cannot serve attention sinks (flash-attn 2 has none): "
    "use attention_backend='triton' (the CUDA default)."
)


def is_available() -> bool:
    return flash_attn_varlen_func is not None and torch.cuda.is_available()


class FlashAttentionBackend(AttentionBackend):
    """Decode-only steps through ``flash_attn_with_kvcache``; mixed steps through
    ``flash_attn_varlen_func`` over the paged cache (``block_table``).

    Decode steps are captured in CUDA graphs (``supports_cuda_graphs``), as the upstream sources
    allow (flash-attn 2.8, ``csrc/flash_attn``):
    - ``mha_fwd_kvcache`` sizes its grid and split-KV count on the host from shapes only (the
      batch, the heads, and ``seqlen_k`` = block-table width x page size), never from
      ``cache_seqlens``, so a replay with other lengths runs the captured launch correctly;
    - its split-KV kernel (``compute_attn_1rowblock_splitkv``) returns early, writing zeros, when
      a row has no key block (``n_block_min >= n_block_max``, "also covers n_block_max <= 0"), so a
      graph's padding rows (``cache_seqlens`` 0) read no KV;
    - the KV write must skip the padding rows' slot -1, which ``index_copy_`` would reject: it is
      the Triton backend's write kernel (Triton ships with CUDA PyTorch).

    Soft-capping is flash-attn's own: since 2.6 both ``flash_attn_varlen_func`` and
    ``flash_attn_with_kvcache`` take ``softcap`` (``flash_attn/flash_attn_interface.py``: "softcap=0.0,
    # 0.0 means deactivated", "Anything > 0 activates softcapping attention"). Attention sinks they have
    not (FA2's interface has no sink argument; ``learnable_sink`` is FA3's): ``supports_sinks`` is False,
    and a model with sinks is refused when built on this backend (``Attention``), never served wrong.
    """

    name = "flash_attn"
    block_size_multiple = 256  # FA2's paged KV requires it
    supports_cuda_graphs = True
    supports_sinks = False
    write_kv = staticmethod(triton_backend.TritonAttentionBackend.write_kv)

    def __init__(self) -> None:  # pragma: no cover - needs CUDA + flash-attn
        if not is_available():
            raise RuntimeError(f"The flash-attn backend needs CUDA and the flash_attn package: {INSTALL_ADVICE}")
        if not triton_backend.is_available():
            raise RuntimeError("flash-attn backend writes the KV cache with a Triton kernel: install triton.")

    def forward(  # pragma: no cover - needs CUDA + flash-attn
        self,
        q,
        k,
        v,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            raise NotImplementedError(SINKS_UNSUPPORTED)
        if k is not None:  # None: a KV-shared layer, whose K/V an earlier layer wrote
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
                softcap=softcap or 0.0,
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
            softcap=softcap or 0.0,
            block_table=meta.block_table,
        )
