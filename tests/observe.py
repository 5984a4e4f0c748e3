"""Observing an engine within one test: the steps it ran and how its counters moved, so a test
checks what *it* caused, never what earlier tests left in a shared (session) engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from cb_serve import EngineStats, StepStats

COUNTERS = ("num_preemptions", "num_partial_prefills", "prefix_cache_queries", "prefix_cache_hits", "num_steps")


@contextlib.contextmanager
def recorded_steps(engine) -> Iterator[list[StepStats]]:
    """The ``StepStats`` of every step ``engine`` (an ``LLMEngine`` or ``AsyncLLM``) runs inside the block."""
    steps: list[StepStats] = []

    def listener(stats: StepStats, _outputs) -> None:
        steps.append(stats)

    engine.add_step_listener(listener)
    try:
        yield steps
    finally:
        engine.remove_step_listener(listener)


@contextlib.contextmanager
def counter_deltas(engine) -> Iterator[dict[str, int]]:
    """How much each scheduler counter grew inside the block (filled in when the block ends)."""
    deltas: dict[str, int] = {}
    before: EngineStats = engine.get_stats()
    yield deltas
    after = engine.get_stats()
    deltas.update({name: getattr(after, name) - getattr(before, name) for name in COUNTERS})
