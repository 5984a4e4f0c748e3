"""State slots of recurrent layers: one per running sequence, beside the paged KV cache.

A recurrent layer (Gated DeltaNet, Mamba2) keeps a fixed-size state per sequence instead of KV blocks
(``kv_cache_interface.StateSpec``). Every such layer of a model indexes its state tensors by one slot id
per sequence (``Sequence.state_slot``), so the engine hands out slots, not per-layer memory. The block
manager owns them: a sequence takes a slot when it is admitted (with its first blocks, or not at all)
and gives it back wherever its blocks go back (finish, abort, error, preemption), so a sequence runs
only with a slot and no slot outlives its sequence. A preempted sequence is recomputed into a fresh
slot, from its first token or from a snapshot of its states (``state_snapshots``, which live in the runner's
slots after these). The runner's last slot is its scratch slot (padding rows of captured graphs and
warm-up, slot -1): never handed out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from cb_serve.config import EngineConfig
from cb_serve.sequence import Sequence

logger = logging.getLogger(__name__)


class StateSlots:
    """Free list of ``num_slots`` slot ids (``max_num_seqs``: every running sequence holds one)."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 handed out first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def take(self, seq: Sequence) -> None:
        """Give ``seq`` a slot (it has none: admission, or readmission after preemption)."""
        assert seq.state_slot < 0 and self._free, (seq.seq_id, seq.state_slot, len(self._free))
        seq.state_slot = self._free.pop()

    def release(self, seq: Sequence) -> None:
        """Take ``seq``'s slot back, if it holds one (idempotent)."""
        if seq.state_slot >= 0:
            self._free.append(seq.state_slot)
            seq.state_slot = -1

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Each slot is free once or held by exactly one live sequence."""
        held = [s.state_slot for s in live if s.state_slot >= 0]
        assert len(set(held)) == len(held), "a slot held twice"
        assert not set(held) & set(self._free) and len(set(self._free)) == len(self._free), "a held slot free"
        assert len(held) + len(self._free) == self.num_slots, "a slot lost"


def recurrent_config(config: EngineConfig, model_type: str) -> EngineConfig:
    """``config`` for a model with recurrent layers: prefix caching resumes from the states kept at block
    boundaries (``state_snapshots``), and is off, logged, when no memory is given to them. (Speculative decoding
    keeps each verify position's state and rolls rejected drafts back: ``model_executor/state_cache.py``.)"""
    no_snapshots = config.num_state_snapshots == 0 or (
        config.num_state_snapshots is None and config.state_snapshot_memory == 0
    )
    if config.enable_prefix_caching and no_snapshots:
        logger.warning(
            "Prefix caching disabled for %s: no recurrent states are kept at block boundaries "
            "(num_state_snapshots or state_snapshot_memory is 0), so a cached prefix could not be resumed.",
            model_type,
        )
        config = dataclasses.replace(config, enable_prefix_caching=False)
    return config
