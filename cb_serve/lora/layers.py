"""The LoRA side of a projection in the ragged step: ``LoRALinear`` adds ``x·Aᵢ·Bᵢ`` to the base
projection's output for the tokens of each adapter ``i`` in the step, batched over requests: on
the CPU in float32, every adapter of the step in one C++ call (``cpu_ops.lora_apply``, Punica's
BGMV form); elsewhere one gathered GEMM pair per adapter (the segmented form)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops

TokenRows = slice | torch.Tensor  # a contiguous run of the step's tokens, or their indices


class LoRABatch:
    """The step's tokens by adapter slot (-1: the base model), as a tensor (for the C++ kernel) and,
    when first asked for, grouped (for the GEMM path); shared by every ``LoRALinear`` of the model,
    set once per step."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None  # None: no token of the step has an adapter
        self._slots = np.empty(0, dtype=np.int64)
        self._groups: list[tuple[int, TokenRows]] | None = []

    def set_groups(self, token_slots: np.ndarray, device: torch.device) -> None:
        """``token_slots``: each token's slot in step order (-1: the base model)."""
        self._slots, self._groups, self.device = token_slots.astype(np.int64), None, device
        self.token_slots = torch.from_numpy(self._slots).to(device) if (self._slots >= 0).any() else None

    @property
    def groups(self) -> list[tuple[int, TokenRows]]:
        if self._groups is None:
            self._groups = group_tokens(self._slots, self.device)
        return self._groups


def group_tokens(token_slots: np.ndarray, device: torch.device) -> list[tuple[int, TokenRows]]:
    """``(slot, rows)`` per adapter slot present: a slice when its tokens are contiguous."""
    groups: list[tuple[int, TokenRows]] = []
    for slot in np.unique(token_slots[token_slots >= 0]).tolist():
        idx = np.flatnonzero(token_slots == slot)
        if idx[-1] - idx[0] + 1 == len(idx):
            groups.append((slot, slice(int(idx[0]), int(idx[-1]) + 1)))
        else:
            groups.append((slot, torch.from_numpy(idx).to(device)))
    return groups


class LoRALinear(nn.Module):
    """A base projection (``model_executor.layers.linear.Linear``, its exact-weight paths unchanged) plus
    ``max_loras`` adapter slots: ``lora_a[s]`` is ``[max_rank_rows, in]``, ``lora_b[s]``
    ``[max_rank_rows, out]``, of which the first ``ranks[s]`` rows hold the adapter in slot ``s``
    (``peft_adapter`` layout; 0: none)."""

    def __init__(self, base: nn.Linear, batch: LoRABatch, max_loras: int, max_rank_rows: int) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        w = base.weight
        self.lora_a = torch.zeros(max_loras, max_rank_rows, base.in_features, dtype=w.dtype, device=w.device)
        self.lora_b = torch.zeros(max_loras, max_rank_rows, base.out_features, dtype=w.dtype, device=w.device)
        self.ranks = [0] * max_loras
        self.ranks_tensor = torch.zeros(max_loras, dtype=torch.int64)  # the same, for the C++ kernel
        self.use_cpu_kernel = w.device.type == "cpu" and w.dtype == torch.float32 and cpu_ops.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if batch.token_slots is None:
            return out
        if self.use_cpu_kernel and x.dim() == 2:
            cpu_ops.lora_apply(out, x.contiguous(), self.lora_a, self.lora_b, batch.token_slots, self.ranks_tensor)
            return out
        return self.add_grouped(out, x)

    def add_grouped(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The GEMM path: per adapter of the step, its tokens gathered, ``(x A^T) B`` added back."""
        for slot, rows in self.batch.groups:
            r = self.ranks[slot]
            if r:
                delta = F.linear(x[rows], self.lora_a[slot, :r]) @ self.lora_b[slot, :r]
                if isinstance(rows, slice):
                    out[rows] += delta
                else:
                    out.index_add_(0, rows, delta)
        return out

    @torch.no_grad()
    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Puts an adapter's ``(A, B)`` for this projection in ``slot`` (None: it does not target it)."""
        r = 0 if weights is None else weights[0].shape[0]
        if weights is not None:
            a, b = weights
            assert r <= self.lora_a.shape[1], (r, self.lora_a.shape)
            self.lora_a[slot, :r].copy_(a)
            self.lora_b[slot, :r].copy_(b)
        self.ranks[slot] = r
        self.ranks_tensor[slot] = r
