"""The scheduler's waiting queue, one per ``scheduling_policy`` (vLLM v1's ``request_queue.py``):
``fcfs`` keeps arrival order and puts preempted sequences back at the front; ``priority`` keeps
(priority, arrival time) order, lower priority values first, and puts preempted sequences back
into that order."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from cb_serve.sequence import Sequence


class WaitingQueue(Protocol):
    """What the scheduler and the engine ask of the waiting queue: index 0 is admitted next."""

    def add(self, seq: Sequence) -> None: ...
    def prepend(self, seq: Sequence) -> None: ...
    def remove(self, seq: Sequence) -> None: ...
    def __getitem__(self, i: int) -> Sequence: ...
    def __delitem__(self, i: int) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSQueue(deque[Sequence]):
    """Arrival order; a preempted sequence goes back to the front (vLLM's ``FCFSRequestQueue``)."""

    def add(self, seq: Sequence) -> None:
        self.append(seq)

    def prepend(self, seq: Sequence) -> None:
        self.appendleft(seq)


class PriorityQueue:
    """Sorted by (priority, arrival time), then by insertion: lower priority values first, as
    vLLM's ``PriorityRequestQueue``; there is no front for a preempted sequence, it goes back into
    that order. A sorted list (not a heap), so the admission loop can index past held-back sequences."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, float, int, Sequence]] = []
        self._order = itertools.count()  # ties broken by insertion: never compares two sequences

    def add(self, seq: Sequence) -> None:
        bisect.insort(self._entries, (seq.priority, seq.times.arrival, next(self._order), seq))

    prepend = add

    def remove(self, seq: Sequence) -> None:
        for i, entry in enumerate(self._entries):
            if entry[3] is seq:
                del self._entries[i]
                return
        raise ValueError(f"{seq} is not waiting")

    def __getitem__(self, i: int) -> Sequence:
        return self._entries[i][3]

    def __delitem__(self, i: int) -> None:
        del self._entries[i]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Sequence]:
        return (entry[3] for entry in self._entries)

    def __repr__(self) -> str:
        return f"PriorityQueue({list(self)})"


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue of ``policy`` ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"Unknown scheduling policy {policy!r} (fcfs or priority).")
