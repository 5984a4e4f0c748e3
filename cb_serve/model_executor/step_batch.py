"""One step's flattened batch on the host (``StepBatch``: numpy arrays, what tensor-parallel ranks
receive), its move to the device (``HostStaging``: on the CPU the arrays themselves, on CUDA one pinned copy
per dtype with every field aligned, so no Triton kernel's specialization follows the batch), and the batch
there (``ModelInput``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cb_serve.attention.base import AttentionMetadata
from cb_serve.model_executor import prompt_logprobs
from cb_serve.sequence import Sequence

# prev_token_*: async scheduling's tokens sampled by the step in flight (index in input_ids, row in its ids)
INT64_FIELDS = ("input_ids", "positions", "slot_mappings", "logits_indices", "prev_token_index", "prev_token_rows")
INT32_FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_tables", "state_slots")


@dataclass
class StepBatch:
    """One step's flattened batch on the host (no padding), as numpy arrays: what the model
    needs, and all that tensor-parallel workers receive (it pickles small)."""

    num_decodes: int
    query_lens: list[int]
    seq_lens: list[int]
    arrays: dict[str, np.ndarray]  # INT64_FIELDS and INT32_FIELDS (prev_token_*: only when there are some)
    prompt_rows: np.ndarray | None = None  # prompt logprobs: [2, R] token index, prompt token (``prompt_logprobs``)
    prompt_top_k: int = 0
    mm: Any = None  # its image tokens (``mm_inputs.MultiModalStep``), where the model reads images
    state_copies: Any = None  # a hybrid model's (``engine.state_snapshots.StateCopies``): restores, saves
    verify_rows: list[int] = field(default_factory=list)  # a hybrid model's rows verifying drafts
    state_rollbacks: list[tuple[int, int]] = field(default_factory=list)  # (slot, verify position): drafts rejected

    @property
    def num_sampling(self) -> int:
        return len(self.arrays["logits_indices"])


class HostStaging:
    """Moves a ``StepBatch`` to the device in one copy per dtype (on the CPU the step's arrays are
    the tensors: nothing is copied). On CUDA the copies come from
    pinned buffers kept across steps (so they are truly asynchronous). A buffer is refilled only
    after its previous copy has run (an event recorded behind it): a step that samples nothing
    never waits on the host, so the GPU may not have reached that copy yet."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned: dict[torch.dtype, torch.Tensor] = {}
        self.copied: dict[torch.dtype, Any] = {}  # torch.cuda.Event recorded after each buffer's last copy

    def to_device(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for names, dtype in ((INT64_FIELDS, torch.int64), (INT32_FIELDS, torch.int32)):
            arrays = [np.asarray(batch.arrays.get(n, _NONE), dtype=dtype_np(dtype)) for n in names]
            if self.device.type == "cpu":  # the host arrays themselves, no copy
                out.update((name, torch.from_numpy(np.ascontiguousarray(a))) for name, a in zip(names, arrays))
                continue
            offsets, total = aligned_offsets([a.size for a in arrays])
            host = np.zeros(total, dtype=dtype_np(dtype))
            for a, offset in zip(arrays, offsets):
                host[offset : offset + a.size] = a.reshape(-1)
            flat = self._stage(torch.from_numpy(host)).to(self.device, non_blocking=True)
            self.copied.setdefault(dtype, torch.cuda.Event()).record()  # on the stream that copies
            for name, a, offset in zip(names, arrays, offsets):
                out[name] = flat[offset : offset + a.size].view(a.shape)
        return out

    def _stage(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` in this dtype's pinned buffer (grown to the next power of two when short)."""
        buf = self.pinned.get(flat.dtype)
        if buf is None or buf.numel() < flat.numel():
            # A replaced buffer is not freed under a pending copy: the pinned allocator records one.
            buf = torch.empty(max(1024, 1 << (flat.numel() - 1).bit_length()), dtype=flat.dtype).pin_memory()
            self.pinned[flat.dtype] = buf
        elif (copied := self.copied.get(flat.dtype)) is not None and not copied.query():
            copied.synchronize()  # the last copy out of this buffer has run (under async scheduling it has)
        staged = buf[: flat.numel()]
        staged.copy_(flat)
        return staged


_NONE = np.zeros(0, dtype=np.int64)
STAGING_ALIGNMENT = 16  # elements: every staged field starts 64- or 128-byte aligned


def aligned_offsets(sizes: list[int], alignment: int = STAGING_ALIGNMENT) -> tuple[list[int], int]:
    """Where each of fields of ``sizes`` elements starts in one flat buffer, each at a multiple of
    ``alignment`` elements, and the buffer's size. The device views of a step's fields are then aligned
    whatever the batch's size, so no Triton kernel meets an alignment class that warm-up did not."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // alignment) * alignment
    return offsets, end


def dtype_np(dtype: torch.dtype) -> type:
    return np.int64 if dtype == torch.int64 else np.int32


@dataclass
class ModelInput:
    """One step's batch on the device: ``input_ids`` / ``positions`` are ``[T]``."""

    batch: StepBatch
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last scheduled token of each sequence that samples
    seqs: list[Sequence] = field(default_factory=list)  # in batch order: single-token (decode) rows first
    sampling_seqs: list[Sequence] = field(default_factory=list)
    rows_per_seq: list[int] = field(default_factory=list)  # logits rows of each sampling sequence: 1 + its drafts
    prompt_rows: torch.Tensor | None = None  # StepBatch.prompt_rows on the device
    prompt_plan: prompt_logprobs.PromptLogprobRows | None = None
