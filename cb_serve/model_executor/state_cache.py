"""A hybrid model's recurrent states on the device (``StateCache``): every recurrent layer's state slots, the
copies between them that a step begins with (rolled-back drafts, restored prefix hits, fresh sequences) or ends
with (snapshots kept), and the rollbacks a verify step leaves for the next one."""

from __future__ import annotations

import torch

from cb_serve.attention.base import AttentionMetadata, host_to_device
from cb_serve.kv_cache_interface import StateSpec
from cb_serve.model_executor.layers.recurrent_rows import verify_positions
from cb_serve.model_executor.step_batch import StepBatch


class StateCache:
    """Per recurrent layer, ``(conv, ssm)`` state tensors ``[num_slots, *shape]`` (float32). The slots, in order:
    a running sequence's (``engine/state_slots.py``); the snapshots (``engine/state_snapshots.py``); with speculative
    decoding, ``num_verify`` per running slot, where a verify step keeps the state after each of a sequence's
    positions but its last (``verify_slot``); last, the runner's scratch (slot -1: warm-up and a graph's padding
    rows)."""

    def __init__(
        self,
        specs: dict[int, StateSpec],
        num_running: int,
        device: torch.device,
        num_snapshots: int = 0,
        num_verify: int = 0,
    ) -> None:
        assert num_running > 0 and num_snapshots >= 0 and num_verify >= 0
        self.num_running, self.num_snapshots, self.num_verify = num_running, num_snapshots, num_verify
        self._device = device
        self._rollbacks: dict[int | str, tuple[int, int]] = {}  # seq id -> (its slot, position), for the next step
        self.num_slots = num_running * (1 + num_verify) + num_snapshots + 1
        self.layers = {
            layer: (
                torch.zeros(self.num_slots, *spec.conv_shape, dtype=torch.float32, device=device),
                torch.zeros(self.num_slots, *spec.ssm_shape, dtype=torch.float32, device=device),
            )
            for layer, spec in specs.items()
        }

    def verify_slot(self, slot: int, position: int) -> int:
        """Where running slot ``slot``'s state after verify position ``position`` (< ``num_verify``) is kept."""
        assert 0 <= slot < self.num_running and 0 <= position < self.num_verify, (slot, position)
        return self.num_running + self.num_snapshots + slot * self.num_verify + position

    def verified(self, seq_id: int | str, slot: int, num_drafts: int, num_accepted: int) -> None:
        """A verify step of ``num_drafts`` drafts kept ``num_accepted``: where some were rejected, the state after
        the last accepted one goes back into ``slot`` when the next step begins (every rank's, in its batch)."""
        if num_accepted < num_drafts:
            self._rollbacks[seq_id] = (slot, num_accepted)

    def rollbacks(self) -> list[tuple[int, int]]:
        """The rollbacks the next step begins with (``StepBatch.state_rollbacks``: slot, verify position; each rank
        finds its own verify slot), dropped once ``begin_step`` has copied them."""
        return list(self._rollbacks.values())

    def release(self, seq_id: int | str) -> None:
        """The sequence gave its slot back: a rollback it left is void (the slot may be another's next)."""
        self._rollbacks.pop(seq_id, None)

    def begin_step(self, batch: StepBatch, meta: AttentionMetadata) -> None:
        """Before a step's forward pass: the previous step's rejected drafts undone (``state_rollbacks``: a verify
        position's state back into its sequence's slot), prefix hits' states restored (``StateCopies.restores``),
        and the slots of the rows that start their sequence (no token computed before) zeroed; the rows verifying
        drafts get their positions (``meta.verify_positions``)."""
        self.copy([(self.verify_slot(slot, j), slot) for slot, j in batch.state_rollbacks])
        self._rollbacks.clear()
        if batch.state_copies is not None:
            self.copy(batch.state_copies.restores)
        slots, device = meta.state_slot_list, self._device
        if batch.verify_rows:
            meta.verify_rows = frozenset(batch.verify_rows)
            cu_q = batch.arrays["cu_seqlens_q"]
            meta.verify_positions = verify_positions(batch.verify_rows, cu_q, batch.query_lens, slots, self.verify_slot,
                                                     device)  # fmt: skip
        fresh = [slot for slot, q, n in zip(slots, batch.query_lens, batch.seq_lens) if q == n and slot >= 0]
        if not fresh:
            return
        index = host_to_device(torch.tensor(fresh), device)
        for conv, ssm in self.layers.values():
            conv.index_fill_(0, index, 0.0)
            ssm.index_fill_(0, index, 0.0)

    def end_step(self, copies) -> None:
        """After a step's forward pass: the states kept at block boundaries (``StateCopies.saves``, or None), a row
        verifying drafts' from the verify slot of the position where the boundary falls (``verify_saves``)."""
        if copies is not None:
            self.copy(copies.saves + [(self.verify_slot(slot, j), dst) for slot, j, dst in copies.verify_saves])

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Slot ``dst`` of every layer's tensors becomes a copy of slot ``src``, for each ``(src, dst)``, in order."""
        if not pairs:
            return
        src, dst = (host_to_device(torch.tensor(column), self._device) for column in zip(*pairs))
        for tensors in self.layers.values():
            for t in tensors:
                t.index_copy_(0, dst, t.index_select(0, src))
