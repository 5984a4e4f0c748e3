"""The LoRA side of a projection in the ragged step: ``LoRALinear`` adds ``x·Aᵢ·Bᵢ`` to the base
projection's output for the tokens of each adapter ``i`` in the step, one gathered GEMM pair per
adapter (Punica's segmented form), never one per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

TokenRows = slice | torch.Tensor  # a contiguous run of the step's tokens, or their indices


@dataclass
class LoRABatch:
    """The step's tokens grouped by adapter slot (base-model tokens are in no group); shared by
    every ``LoRALinear`` of the model and set once per step by ``set_groups``."""

    groups: list[tuple[int, TokenRows]] = field(default_factory=list)

    def set_groups(self, token_slots: np.ndarray, device: torch.device) -> None:
        """``token_slots``: each token's slot in step order (-1: the base model)."""
        self.groups = group_tokens(token_slots, device)


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
    """A base projection (``model_executor.linear.Linear``, its exact-weight paths unchanged) plus
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
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
        if weights is None:
            self.ranks[slot] = 0
            return
        a, b = weights
        r = a.shape[0]
        assert r <= self.lora_a.shape[1], (r, self.lora_a.shape)
        self.lora_a[slot, :r].copy_(a)
        self.lora_b[slot, :r].copy_(b)
        self.ranks[slot] = r
