"""Reporting: logging, run metadata (which cb_serve was measured), JSON output, and the offline benchmark's
per-system results (``SystemResult``), their greedy-output agreement, batch invariance and the comparison table."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import cb_serve
from cb_serve.benchmarks.cpu_accounting import CONTENTION_WARNING, Timer
from cb_serve.benchmarks.workload import Workload


def log(message: str) -> None:
    print(message, flush=True)


def write_json(path: str | None, out: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        log(f"wrote {path}")


def _git(directory: Path, *args: str) -> str:
    run = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True, timeout=30)
    return run.stdout.rstrip("\n")


def cb_serve_source() -> dict[str, Any]:
    """Which cb_serve was measured: its directory and, in a git checkout, the commit and modified files."""
    directory = Path(cb_serve.__file__).resolve().parent
    info: dict[str, Any] = {"path": str(directory)}
    try:
        info["commit"] = _git(directory, "rev-parse", "--short", "HEAD")
        info["modified"] = [line[3:] for line in _git(directory, "status", "--porcelain", "--", ".").splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout (e.g. an exported commit on PYTHONPATH)
    return info


def run_info(started: str) -> dict[str, Any]:
    """The first keys of a benchmark's JSON: when, the command line, Python and torch versions."""
    return {
        "started": started,
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


# ---- offline results -----------------------------------------------------------------------------------------
@dataclass
class SystemResult:
    name: str
    wall_s: float
    generated_tokens: int  # each request's own requested output tokens only
    processed_tokens: int  # prompt tokens + generated tokens (useful work; padding and waste excluded)
    outputs: list[list[int]] = field(repr=False)  # per request, cut to its requested length
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def generated_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s

    @property
    def processed_tok_s(self) -> float:
        return self.processed_tokens / self.wall_s

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "generated_tokens": self.generated_tokens,
            "processed_tokens": self.processed_tokens,
            "generated_tok_s": self.generated_tok_s,
            "processed_tok_s": self.processed_tok_s,
            **self.extra,
        }


def make_result(name: str, timer: Timer, workload: Workload, outputs: list[list[int]], **extra: Any) -> SystemResult:
    """A system's result; checks that every request produced exactly its requested output length."""
    for i, (out, want) in enumerate(zip(outputs, workload.output_lens)):
        if len(out) != want:
            raise RuntimeError(f"{name}: request {i} produced {len(out)} tokens, expected {want}.")
    generated = sum(len(o) for o in outputs)
    return SystemResult(
        name, timer.wall_s, generated, workload.prompt_tokens + generated, outputs, {**extra, **timer.to_json()}
    )


def agreement(reference: Sequence[list[int]], other: Sequence[list[int]]) -> dict[str, float]:
    """Greedy-output agreement: identical requests and mean fraction of the common prefix."""
    same = sum(a == b for a, b in zip(reference, other))
    prefix = []
    for a, b in zip(reference, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), 1))
    return {"identical_requests": same / len(reference), "mean_common_prefix": statistics.fmean(prefix)}


def batch_invariance(batched: Sequence[list[int]], sequential: Sequence[list[int]]) -> dict[str, int]:
    """How many requests produced the same greedy tokens alone (one in flight) as in the batched run."""
    return {"requests": len(sequential), "identical": sum(a == b for a, b in zip(batched, sequential))}


def print_system(result: SystemResult) -> None:
    log(
        f"[{result.name}] {result.generated_tokens} generated tokens in {result.wall_s:.1f} s: "
        f"{result.generated_tok_s:.1f} generated tok/s, {result.processed_tok_s:.1f} processed tok/s"
    )
    for key, value in result.extra.items():
        log(f"    {key}: {value:.3f}" if isinstance(value, float) else f"    {key}: {value}")


def print_systems_table(
    results: dict[str, SystemResult], workload_roofline: float, other_shares: Sequence[float | None]
) -> None:
    """Each system's wall time, rates, fraction of the workload roofline, cb-serve's speedup over it, its
    requests with outputs identical to hf-static's, its batch invariance (requests identical when run
    alone) and foreign CPU share; a warning when any measurement (``other_shares``: e.g. the roofline's)
    was contended."""
    header = ("wall s", "gen tok/s", "proc tok/s", "of roofline", "cb-serve/x", "=hf-static", "alone=", "foreign CPU")
    widths = (8, 10, 11, 12, 11, 11, 8, 12)
    log(f"{'system':15s} " + " ".join(f"{h:>{w}s}" for h, w in zip(header, widths)))
    cb, hf = results.get("cb-serve"), results.get("hf-static")
    for r in results.values():
        foreign = r.extra.get("foreign_cpu_share")
        invariance = r.extra.get("batch_invariance")
        cells = (
            f"{r.wall_s:.1f}",
            f"{r.generated_tok_s:.1f}",
            f"{r.processed_tok_s:.1f}",
            f"{r.generated_tok_s / workload_roofline:.1%}",
            "n/a" if cb is None else f"{cb.generated_tok_s / r.generated_tok_s:.2f}x",
            "n/a" if hf is None else f"{sum(a == b for a, b in zip(hf.outputs, r.outputs))}/{len(r.outputs)}",
            "n/a" if invariance is None else f"{invariance['identical']}/{invariance['requests']}",
            "n/a" if foreign is None else f"{foreign:.1%}",
        )
        log(f"{r.name:15s} " + " ".join(f"{c:>{w}s}" for c, w in zip(cells, widths)))
    shares = [r.extra.get("foreign_cpu_share") or 0.0 for r in results.values()] + [s or 0.0 for s in other_shares]
    if max(shares) > CONTENTION_WARNING:
        log(
            f"WARNING: other processes kept up to {max(shares):.0%} of the CPUs busy during a measurement; "
            "the numbers above are not representative (rerun on an idle machine)."
        )


PEERS = ("hf-static", "hf-continuous", "llama.cpp")  # the systems cb-serve's speed is compared with


def key_name(system: str) -> str:
    """A system's name as a JSON key part: ``llama.cpp`` -> ``llama_cpp``."""
    return system.replace("-", "_").replace(".", "_")


def cb_serve_ratios(results: dict[str, SystemResult], workload_roofline: float) -> dict[str, float]:
    """cb-serve's fraction of the roofline and speedup over each peer; records (and prints) each peer's
    greedy-output agreement with cb-serve in its ``extra``, and that of the systems that are not HF's
    with hf-static (``agreement_with_hf_static_*``)."""
    ratios: dict[str, float] = {}
    reference = results.get("hf-static")
    for name in ("cb-serve", "llama.cpp"):
        if reference is not None and name in results:
            agree = agreement(reference.outputs, results[name].outputs)
            results[name].extra.update({f"agreement_with_hf_static_{k}": v for k, v in agree.items()})
            log(f"{name} greedy outputs identical to hf-static's for {agree['identical_requests']:.0%} of requests")
    cb = results.get("cb-serve")
    if cb is None:
        return ratios
    ratios["cb_serve_fraction_of_roofline"] = cb.generated_tok_s / workload_roofline
    for other in PEERS:
        if other not in results:
            continue
        ratio = ratios["cb_serve_over_" + key_name(other)] = cb.generated_tok_s / results[other].generated_tok_s
        agree = agreement(cb.outputs, results[other].outputs)
        results[other].extra.update({f"agreement_with_cb_serve_{k}": v for k, v in agree.items()})
        log(
            f"cb-serve / {other}: {ratio:.2f}x "
            f"(greedy outputs identical for {agree['identical_requests']:.0%} of requests, "
            f"mean common prefix {agree['mean_common_prefix']:.0%})"
        )
    log(f"cb-serve fraction of the workload roofline: {ratios['cb_serve_fraction_of_roofline']:.1%}")
    return ratios
