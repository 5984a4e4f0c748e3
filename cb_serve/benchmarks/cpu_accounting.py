"""CPU accounting: did the benchmark have the machine to itself?

A measurement records how many CPU seconds the whole machine was busy (``/proc/stat``) and how many of them
were its own; the rest, as a share of all cores over the wall time, is the *foreign* CPU share (0 = the
machine was ours, 1 = other processes kept every core busy). Linux only; elsewhere the share is None.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONTENTION_WARNING = 0.05  # foreign CPU share above which a measurement is flagged

ProcStats = dict[int, tuple[int, float]]  # pid -> (parent pid, CPU seconds incl. waited-for children)


def busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux ``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process, all of its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def foreign_share(busy_s: float, ours_s: float, wall_s: float) -> float:
    """Share of all cores that others used, given the machine's busy and our CPU seconds over ``wall_s``."""
    return max(0.0, busy_s - ours_s) / (wall_s * (os.cpu_count() or 1))


def contended(share: float | None) -> bool:
    """Whether a foreign CPU share makes a measurement unrepresentative."""
    return share is not None and share > CONTENTION_WARNING


class Timer:
    """Wall time of a block, plus how busy *other* processes kept the CPUs meanwhile: the benchmark
    needs the machine to itself, and ``foreign_cpu_share`` (0 = idle, 1 = all cores busy) says if it had it."""

    def __enter__(self) -> Timer:
        self._busy, self._own = busy_cpu_seconds(), own_cpu_seconds()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._start
        self.own_cpu_s = own_cpu_seconds() - self._own
        busy = busy_cpu_seconds()
        self.foreign_cpu_share: float | None = None
        if busy is not None and self._busy is not None:
            self.foreign_cpu_share = foreign_share(busy - self._busy, self.own_cpu_s, self.wall_s)

    def to_json(self) -> dict[str, Any]:
        return {"own_cpu_s": self.own_cpu_s, "foreign_cpu_share": self.foreign_cpu_share}


# ---- process trees (a server and its worker processes) ------------------------------------------------------
def proc_stats() -> ProcStats:
    """Parent pid and CPU seconds of every process (Linux ``/proc``)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK"))
    return out


def descendants(roots: Sequence[int], stats: ProcStats | None = None) -> list[int]:
    """``roots`` (those alive) and their live descendants."""
    stats = proc_stats() if stats is None else stats
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [r for r in roots if r in stats]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def tree_cpu_seconds(roots: Sequence[int]) -> float:
    """CPU seconds of ``roots`` and their live descendants (the client, `serve run` and its Ray processes)."""
    stats = proc_stats()
    return sum(stats[pid][1] for pid in descendants(roots, stats))


class Contention:
    """Share of the machine's CPU (0 = none, 1 = all cores) that processes outside ``roots`` and their
    descendants used meanwhile; None for ``roots=None`` (an external server's processes are not ours to
    tell apart)."""

    def __init__(self, roots: Sequence[int] | None) -> None:
        self.roots = list(roots or [])
        self.enabled = roots is not None and busy_cpu_seconds() is not None

    def __enter__(self) -> Contention:
        if self.enabled:
            self._busy, self._ours, self._start = busy_cpu_seconds(), tree_cpu_seconds(self.roots), time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.foreign_cpu_share: float | None = None
        if self.enabled:
            wall = time.time() - self._start
            ours = tree_cpu_seconds(self.roots) - self._ours
            self.foreign_cpu_share = foreign_share(busy_cpu_seconds() - self._busy, ours, wall)
