"""Attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """A ragged batch: sequence ``i`` owns query tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``
    of the flattened batch and attends to the first ``seq_lens[i]`` tokens of its KV
    (cached context plus the new tokens, whose KV goes to ``slot_mapping``).

    Sequences with one query token come first (``num_decodes`` of them).
    """

    num_decodes: int
    query_lens: list[int]  # host copies, for backends that loop or size grids
    seq_lens: list[int]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    cu_seqlens_k: torch.Tensor  # int32 [B + 1]
    seqused_k: torch.Tensor  # int32 [B]
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # int32 [B, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [T]
    backend_cache: dict = field(default_factory=dict)  # per-step plans a backend builds once, used by all layers

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and computes causal attention.

    ``kv_cache`` of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    (flash-attn's paged layout for K and V).
    """

    name: str = "base"
    block_size_multiple: int = 1  # the backend's constraint on the KV block size
    # Decode-only steps capturable in a CUDA graph: launches depend only on tensor shapes, rows with
    # seqused_k == 0 / slot_mapping == -1 (graph padding) write no KV and return zeros.
    supports_cuda_graphs: bool = False
    # Attends float32 queries over a bf16/fp16 cache (``kv_cache_dtype`` narrower than the model's).
    supports_narrow_kv_cache: bool = False
    # The model may run its fused C++ CPU layer ops (RMSNorm, RoPE, SiLU-and-mul, packed GEMMs) beside it.
    supports_fused_cpu_ops: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
