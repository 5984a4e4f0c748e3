"""Serving statistics, one code path for every system: per-request records (``RequestResult``), their
summary (throughputs; mean and percentiles of TTFT, TPOT, ITL, end-to-end latency and queueing), the
results as a markdown table, and the comparison of two systems on the same trace."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
# The comparison table: (label, summary key, distribution key or None, higher is better).
COMPARED = (
    ("output tok/s", "output_tokens_per_s", None, True),
    ("requests/s", "request_throughput_per_s", None, True),
    ("TTFT p50 (ms)", "ttft", "p50_ms", False),
    ("TTFT p99 (ms)", "ttft", "p99_ms", False),
    ("ITL p50 (ms)", "itl", "p50_ms", False),
    ("ITL p99 (ms)", "itl", "p99_ms", False),
    ("TPOT p50 (ms)", "tpot", "p50_ms", False),
    ("e2e p50 (ms)", "e2e_latency", "p50_ms", False),
    ("e2e p99 (ms)", "e2e_latency", "p99_ms", False),
)
LATENCIES = (
    ("ttft", "TTFT"),
    ("tpot", "TPOT"),
    ("itl", "ITL"),
    ("e2e_latency", "end-to-end"),
    ("queue", "queue (arrival to service)"),
)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # requested
    ok: bool = False
    completion_tokens: int = 0  # as the server's usage reports them (HF: tokens streamed for the request)
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    arrival_s: float = 0.0  # the trace's arrival time, seconds after the start
    queue_s: float = 0.0  # arrival to service start (cb-serve: the client's wait for --max-concurrency; HF: batch)
    batch_size: int = 0  # HF: requests in its generate() batch


def distribution(values: Sequence[float]) -> dict[str, float]:
    """Mean and percentiles in milliseconds."""
    if not values:
        return {"mean_ms": float("nan"), **{f"p{p}_ms": float("nan") for p in PERCENTILES}}
    ms = np.asarray(values) * 1000
    return {"mean_ms": float(ms.mean()), **{f"p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(duration_s: float, results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    return {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput_per_s": len(ok) / duration_s,
        "output_tokens_per_s": output_tokens / duration_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration_s,
        "ttft": distribution([r.ttft_s for r in ok]),
        "tpot": distribution(tpot),
        "itl": distribution([gap for r in ok for gap in r.itl_s]),
        "e2e_latency": distribution([r.latency_s for r in ok]),
        "queue": distribution([r.queue_s for r in ok]),
    }


def table(summary: dict[str, Any]) -> str:
    """The results as a markdown table."""
    lines = [
        f"| requests completed / failed | {summary['completed']} / {summary['failed']} |",
        f"| duration | {summary['duration_s']:.1f} s |",
        f"| request throughput | {summary['request_throughput_per_s']:.3f} req/s |",
        f"| output token throughput | {summary['output_tokens_per_s']:.1f} tok/s |",
        f"| total token throughput (prompt + output) | {summary['total_tokens_per_s']:.1f} tok/s |",
    ]
    head = ["| metric | value |", "|---|---|"]
    latency = ["", "| latency (ms) | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    for name, label in LATENCIES:
        d = summary[name]
        latency.append(f"| {label} | {d['mean_ms']:.1f} | " + " | ".join(f"{d[f'p{p}_ms']:.1f}" for p in PERCENTILES))
        latency[-1] += " |"
    return "\n".join(head + lines + latency)


def comparison(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per metric: each system's value and, with both systems, cb-serve's advantage (cb-serve / HF for
    throughputs, HF / cb-serve for latencies: > 1 means cb-serve is better)."""
    rows: dict[str, dict[str, float | None]] = {}
    for label, key, sub, higher_is_better in COMPARED:
        row: dict[str, float | None] = {name: (s[key] if sub is None else s[key][sub]) for name, s in summaries.items()}
        if "cb-serve" in row and "hf" in row:
            cb, hf = row["cb-serve"], row["hf"]
            num, den = (cb, hf) if higher_is_better else (hf, cb)
            row["ratio"] = num / den if den and not math.isnan(den) and not math.isnan(num) else None
        rows[label] = row
    return {"ratio": "cb-serve / HF for throughputs, HF / cb-serve for latencies (> 1: cb-serve better)", "rows": rows}


def comparison_table(comp: dict[str, Any], systems: Sequence[str]) -> str:
    both = "cb-serve" in systems and "hf" in systems
    head = "| metric | " + " | ".join(systems) + (" | cb-serve advantage |" if both else " |")
    lines = [head, "|---|" + "---:|" * (len(systems) + both)]
    for label, row in comp["rows"].items():
        cells = [f"{row[s]:.3f}" if label == "requests/s" else f"{row[s]:.1f}" for s in systems]
        if both:
            cells.append("n/a" if row.get("ratio") is None else f"{row['ratio']:.2f}x")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
