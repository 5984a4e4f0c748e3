"""Step time by phase, from the ``StepStats`` the engine hands its step listeners: each step's
``phases`` (``StepPhases``: schedule, prepare, execute, output) summed over all steps, decode-only
steps and steps with prefill, as ms per step and as a share of the step time."""

from __future__ import annotations

import statistics
from typing import Any

from cb_serve import StepStats
from cb_serve.benchmarks.report import log

# The engine's phases, in order (``StepPhases`` fields without ``_s``); together they are the step's time.
PHASES = ("schedule", "prepare", "execute", "output")


def step_kind(stats: StepStats) -> str:
    return "with prefill" if stats.num_prefill_tokens else "decode only"


def phase_seconds(stats: StepStats) -> dict[str, float]:
    return {phase: getattr(stats.phases, f"{phase}_s") for phase in PHASES}


def breakdown(steps: list[StepStats]) -> dict[str, dict[str, Any]]:
    """Per group of steps (all, decode only, with prefill; empty groups left out): counts, mean step,
    and each phase's ms per step and share of the group's step time."""
    groups = {
        "all steps": steps,
        "decode only": [s for s in steps if step_kind(s) == "decode only"],
        "with prefill": [s for s in steps if step_kind(s) == "with prefill"],
    }
    out: dict[str, dict[str, Any]] = {}
    for label, group in groups.items():
        if not group:
            continue
        total = sum(s.duration_s for s in group)
        sums = {p: sum(phase_seconds(s)[p] for s in group) for p in PHASES}
        out[label] = {
            "steps": len(group),
            "total_s": total,
            "mean_step_ms": 1e3 * total / len(group),
            "mean_seqs": statistics.fmean(s.num_seqs for s in group),
            "mean_tokens": statistics.fmean(s.num_scheduled_tokens for s in group),
            "phase_ms_per_step": {p: 1e3 * s / len(group) for p, s in sums.items()},
            "phase_share": {p: s / total for p, s in sums.items()},
        }
    return out


def print_breakdown(table: dict[str, dict[str, Any]]) -> None:
    labels = list(table)
    log("")
    log("== step time by phase: ms per step (share of step time) ==")
    log(f"{'':26s}" + "".join(f"{label:>24s}" for label in labels))
    for key, fmt in (("steps", "{:d}"), ("mean_seqs", "{:.1f}"), ("mean_tokens", "{:.1f}"), ("mean_step_ms", "{:.1f}")):
        log(f"{key:26s}" + "".join(f"{fmt.format(table[label][key]):>24s}" for label in labels))
    for phase in PHASES:
        cells = [
            f"{table[label]['phase_ms_per_step'][phase]:.2f} ({table[label]['phase_share'][phase]:.1%})"
            for label in labels
        ]
        log(f"{phase:26s}" + "".join(f"{c:>24s}" for c in cells))
