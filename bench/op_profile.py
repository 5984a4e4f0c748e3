"""Operator-level view of engine steps: ``torch.profiler`` (CPU) over the first step and a few decode-only
steps of a workload, ranked by self CPU time. This is where the split inside the model shows: attention
(``paged_*_attention``, ``write_kv``) against the GEMMs (projections and the LM head) and the small ops
(norms, RoPE, activation, the sampler's argmax); ``OP_KINDS`` rolls the ops up into those kinds.

The engine is driven through its public interface only (``add_request``, ``step``, ``abort_request``, a
step listener): a step is profiled as "decode only" when the step before it had no prefill tokens and at
least ``min_decode_seqs`` sequences, and counted only if its own ``StepStats`` confirm it."""

from __future__ import annotations

from typing import Any

from cb_offline import greedy, recording_steps

from cb_serve import LLM, StepStats
from cb_serve.benchmarks.report import log
from cb_serve.benchmarks.workload import Workload

PROFILED_DECODE_STEPS = 5
TOP_OPS = 15
# Op kinds, first match wins: (kind, substrings of the op name).
OP_KINDS = (
    ("attention", ("attention", "write_kv")),
    ("gemm", ("gemm", "aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm")),
)

OpTotals = dict[str, dict[str, float]]  # op name -> self_us, calls (summed over the profiled steps)


def op_kind(name: str) -> str:
    return next((kind for kind, parts in OP_KINDS if any(p in name for p in parts)), "other")


def is_full_decode(stats: StepStats, min_seqs: int) -> bool:
    return not stats.num_prefill_tokens and stats.num_seqs >= min_seqs


def profiled_step(llm: LLM, into: OpTotals) -> None:
    """One engine step under ``torch.profiler``; its ops' self CPU time and calls added to ``into``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.engine.step()
    for event in prof.key_averages():
        entry = into.setdefault(event.key, {"self_us": 0.0, "calls": 0})
        entry["self_us"] += event.self_cpu_time_total
        entry["calls"] += event.count


def profile_steps(llm: LLM, workload: Workload) -> tuple[dict[str, OpTotals], dict[str, int]]:
    """Runs ``workload`` step by step, profiling the first step and ``PROFILED_DECODE_STEPS`` decode-only
    steps with many sequences; the rest of the workload is aborted once those are seen."""
    engine = llm.engine
    ids = [f"prof-{i}" for i in range(workload.num_requests)]
    for request_id, prompt, n in zip(ids, workload.prompts, workload.output_lens):
        engine.add_request(request_id, prompt, greedy(n))
    totals: dict[str, OpTotals] = {"first step": {}, "decode only": {}}
    counts = {"first step": 0, "decode only": 0}
    min_decode_seqs = max(1, min(32, workload.num_requests // 2))
    with recording_steps(llm) as steps:
        while engine.has_unfinished_requests() and counts["decode only"] < PROFILED_DECODE_STEPS:
            if not steps:
                label = "first step"
            elif is_full_decode(steps[-1], min_decode_seqs):
                label = "decode only"
            else:
                engine.step()
                continue
            ran, ops = len(steps), {}
            profiled_step(llm, ops)
            if len(steps) == ran or (label == "decode only" and not is_full_decode(steps[-1], min_decode_seqs)):
                continue  # no step ran, or it was not what its predecessor promised
            counts[label] += 1
            for name, op in ops.items():
                entry = totals[label].setdefault(name, {"self_us": 0.0, "calls": 0})
                entry["self_us"] += op["self_us"]
                entry["calls"] += op["calls"]
    engine.abort_request(ids)  # seen enough: skip the rest of the workload
    return totals, counts


def rank(ops: OpTotals, num_steps: int) -> list[dict[str, Any]]:
    """The ``TOP_OPS`` ops with the most self CPU time: ms per step, share of all ops, calls per step."""
    total = sum(op["self_us"] for op in ops.values())
    ranked = sorted(ops.items(), key=lambda kv: -kv[1]["self_us"])
    return [
        {
            "op": name,
            "self_ms_per_step": op["self_us"] / 1e3 / num_steps,
            "share": op["self_us"] / total,
            "calls_per_step": op["calls"] / num_steps,
        }
        for name, op in ranked[:TOP_OPS]
    ]


def kinds(ops: OpTotals, num_steps: int) -> dict[str, dict[str, float]]:
    """All ops rolled up by ``op_kind``: self ms per step and share."""
    total = sum(op["self_us"] for op in ops.values())
    out = {kind: {"self_ms_per_step": 0.0, "share": 0.0} for kind, _ in (*OP_KINDS, ("other", ()))}
    for name, op in ops.items():
        entry = out[op_kind(name)]
        entry["self_ms_per_step"] += op["self_us"] / 1e3 / num_steps
        entry["share"] += op["self_us"] / total
    return out


def op_profile(llm: LLM, workload: Workload) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Top ops per profiled kind of step (printed), and all ops rolled up by kind."""
    totals, counts = profile_steps(llm, workload)
    result: dict[str, list[dict[str, Any]]] = {}
    by_kind: dict[str, Any] = {}
    for label, ops in totals.items():
        if not counts[label]:
            continue
        result[label], by_kind[label] = rank(ops, counts[label]), kinds(ops, counts[label])
        log("")
        log(f"== torch.profiler, {label} ({counts[label]} step(s)): top ops by self CPU time ==")
        for row in result[label]:
            log(
                f"    {row['op']:40s} {row['self_ms_per_step']:9.2f} ms/step {row['share']:6.1%}"
                f" {row['calls_per_step']:8.0f} calls/step"
            )
        parts = [f"{kind} {k['self_ms_per_step']:.2f} ms ({k['share']:.1%})" for kind, k in by_kind[label].items()]
        log("    by kind: " + ", ".join(parts))
    return result, by_kind
