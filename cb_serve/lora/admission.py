"""Which waiting sequences the scheduler may admit while ``max_loras`` adapter slots exist: the
running sequences hold at most ``max_loras`` adapters. A sequence whose adapter has no slot waits,
holding nothing, while sequences behind it (of adapters already running, or of the base model)
go ahead; after ``MAX_LORA_WAIT_STEPS`` admissions passed over, no adapter sequence goes ahead of
it until the running adapters drain and free a slot."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from cb_serve.lora_request import LoRARequest

MAX_LORA_WAIT_STEPS = 64


class Waiter(Protocol):
    """What the rule reads of a sequence (``cb_serve.sequence.Sequence``)."""

    lora: LoRARequest | None
    lora_wait_steps: int


class LoRAAdmission:
    """The scheduler's admission gate under adapters: ``begin`` each admission round with the
    running sequences, ask ``may_admit`` of each waiting one in queue order, tell ``admitted``."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.adapters: set[tuple[str, int, str]] = set()
        self.starving = False

    def begin(self, running: Iterable[Waiter]) -> None:
        self.adapters = {seq.lora.key for seq in running if seq.lora is not None}
        self.starving = False  # a sequence waited too long for a slot: no more adapter sequences go ahead of it

    def may_admit(self, seq: Waiter) -> bool:
        lora = seq.lora
        if lora is None or (not self.starving and lora.key in self.adapters):
            return True
        if not self.starving and len(self.adapters) < self.max_loras:
            return True
        seq.lora_wait_steps += 1
        self.starving = self.starving or seq.lora_wait_steps > MAX_LORA_WAIT_STEPS
        return False

    def admitted(self, seq: Waiter) -> None:
        if seq.lora is not None:
            self.adapters.add(seq.lora.key)
            seq.lora_wait_steps = 0
