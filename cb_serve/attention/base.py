"""Attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """A ragged batch: sequence ``i`` owns query tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``
    of the flattened batch and attends to the first ``seq_lens[i]`` tokens of its KV
    (cached context plus the new tokens, whose KV goes to ``slot_mapping``).

    Sequences with one query token come first (``num_decodes`` of them).

    With several KV-cache groups (``kv_cache_interface``), ``kv_block_tables`` / ``kv_slot_mappings``
    hold every group's and ``block_table`` / ``slot_mapping`` the first group's; a layer reads its
    group's metadata, ``for_layer(i)``.
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
    kv_block_tables: torch.Tensor | None = None  # int32 [G, B, max_blocks]: each KV-cache group's
    kv_slot_mappings: torch.Tensor | None = None  # int64 [G, T]
    layer_groups: tuple[int, ...] = ()  # each layer's KV-cache group (empty: one group)
    group_metas: dict = field(default_factory=dict, repr=False)  # group -> its metadata, made once per step
    state_slots: torch.Tensor | None = None  # int32 [B]: each sequence's recurrent-state slot (hybrid models)
    state_slot_list: list[int] = field(default_factory=list)  # the same, on the host
    # Rows verifying drafts on a hybrid model, and their tokens position by position (``recurrent_rows``)
    verify_rows: frozenset[int] = frozenset()
    verify_positions: list = field(default_factory=list)
    # Prefill rows whose image tokens attend to each other both ways (Gemma 3): row -> the (start, end)
    # positions of each image in its chunk. A query in one sees its whole image, later tokens included.
    bidirectional_spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata of ``layer``'s KV-cache group: its block tables and slots (and plans of its own)."""
        group = self.layer_groups[layer] if self.layer_groups else 0
        if group == 0:
            return self
        meta = self.group_metas.get(group)
        if meta is None:
            assert self.kv_block_tables is not None and self.kv_slot_mappings is not None
            meta = dataclasses.replace(
                self,
                block_table=self.kv_block_tables[group],
                slot_mapping=self.kv_slot_mappings[group],
                backend_cache={},
                group_metas={},
            )
            self.group_metas[group] = meta
        return meta


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
    # Attention sinks (``forward``'s ``sinks``); every backend soft-caps (``softcap``).
    supports_sinks: bool = True
    # ``rope_and_write_kv``: RoPE on q and k with the KV write in one kernel (then ``forward`` gets no k/v).
    supports_fused_rope_kv: bool = False
    # ``meta.bidirectional_spans`` (image tokens attending both ways); a layer takes the PyTorch reference
    # for the steps that have some where its backend does not (``layers.attention.Attention.attend``).
    supports_bidirectional_spans: bool = False

    def rope_and_write_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Rotate-half RoPE on ``q`` (returned, a new tensor) and ``k``, whose rotated rows go into
        ``kv_cache`` with ``v``'s at ``slot_mapping`` (``cos``/``sin``: ``[T, rotary_dim]``, the model's dtype)."""
        raise NotImplementedError(f"{self.name} does not fuse RoPE with the KV write")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None: no new K/V to write (a KV-shared layer)
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of the batch over its cached context plus the new tokens. ``k``/``v`` None:
        the new tokens' K/V are already in ``kv_cache`` (an earlier layer sharing it wrote them this step),
        nothing is written and every key is read from the cache. ``softcap``
        (Gemma 2): scores ``cap * tanh(scores / cap)`` before the mask and softmax. ``sinks`` (gpt-oss,
        float ``[num_heads]``): a learned logit per head that joins the softmax denominator as one more
        column with no value (``exp(sink - m)``), so a row's weights may sum to less than one."""

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        fp8 = kv_cache.dtype == torch.float8_e4m3fn  # copied as bytes: no FP8 index_copy_
        for cache, x in zip(kv_cache, (k, v)):
            x = to_cache_dtype(x, kv_cache.dtype)
            cache, x = (cache.view(torch.uint8), x.view(torch.uint8)) if fp8 else (cache, x)
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the KV cache stores it: cast, and for an FP8 cache first saturated at +-448 (vLLM's
    ``SATFINITE`` conversion; a plain cast would turn larger values into NaN), rounded to nearest even."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def host_to_device(x: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or tensor on ``device`` without a wait (the step's host data: attention plans, sampling
    parameters, index rows). A CUDA copy goes from pinned memory, so ``non_blocking`` really is (from pageable
    memory the host waits for the stream: a step launched ahead would stall); PyTorch's pinned-memory
    allocator keeps the block until the copy is done, so the host tensor may go at once. Elsewhere a plain
    copy (none on the CPU)."""
    host = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
