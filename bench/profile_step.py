"""Where one cb-serve engine step spends its time, by timing the engine's phases from outside.

Runs the throughput benchmark's workload (same flags and seed as ``bench/throughput.py``) through cb-serve
only, with wall-clock timers monkeypatched (in this process only; cb_serve is not modified) around:

  schedule      Scheduler.schedule
  prepare       ModelRunner.prepare: token ids, positions, block tables, slot mapping -> tensors
  forward       the model body (embedding + decoder layers); ``attention`` is the part inside the
                attention backend (KV-cache write + paged attention), ``forward - attention`` the rest
                (projections, MLP, norms, RoPE)
  logits        final norm + LM head on the rows that sample
  sampling      SamplingBatch.from_seqs + Sampler (argmax, .tolist())
  update        Scheduler.update_after_step (num_computed_tokens, prefix-cache block registration)
  append_token  LLMEngine._append_token without detokenize (stop checks, finishing sequences)
  detokenize    IncrementalDetokenizer.append
  make_output   RequestState.make_output (RequestOutput objects)
  rest          the step's wall time minus all of the above (_record_step, dict bookkeeping, ...)

and then runs ``torch.profiler`` over the first step and a few decode-only steps of a second workload
(seed + 1, so prompts do not hit the prefix cache) for an operator-level view.

Run from the repository root (about 2-3 minutes for 64 requests on 2 cores; needs an otherwise idle machine):
    .venv/bin/python bench/profile_step.py
    .venv/bin/python bench/profile_step.py --num-requests 16 --max-num-batched-tokens 1024 --json /tmp/prof.json
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from throughput import Timer, Workload, engine_kwargs, log, make_workload, parse_args, write_json

from cb_serve import LLM, SamplingParams
from cb_serve.engine.detokenizer import IncrementalDetokenizer
from cb_serve.engine.request_state import RequestState
from cb_serve.engine.stats import StepStats
from cb_serve.model_executor.sampler import SamplingBatch

# Reported phases, in order; "rest" is derived. Nested timers: attention in forward, detokenize in append_token.
PHASES = (
    "schedule",
    "prepare",
    "forward (non-attention)",
    "attention",
    "logits",
    "sampling",
    "execute (other)",
    "update",
    "append_token",
    "detokenize",
    "make_output",
    "rest",
)
PROFILED_DECODE_STEPS = 5
_MISSING = object()
TOP_OPS = 15


@dataclass
class StepRecord:
    stats: StepStats
    total_s: float
    raw: dict[str, float]  # timer name -> seconds, nested timers included in their parents

    def phases(self) -> dict[str, float]:
        r = defaultdict(float, self.raw)
        sampling = r["from_seqs"] + r["sampler"]
        out = {
            "schedule": r["schedule"],
            "prepare": r["prepare"],
            "forward (non-attention)": r["forward"] - r["attention"],
            "attention": r["attention"],
            "logits": r["logits"],
            "sampling": sampling,
            "execute (other)": r["execute"] - r["forward"] - r["logits"] - sampling,
            "update": r["update"],
            "append_token": r["append_token"] - r["detokenize"],
            "detokenize": r["detokenize"],
            "make_output": r["make_output"],
        }
        top_level = ("schedule", "prepare", "execute", "update", "append_token", "make_output")
        out["rest"] = self.total_s - sum(r[k] for k in top_level)
        return out

    @property
    def kind(self) -> str:
        return "with prefill" if self.stats.num_prefill_tokens else "decode only"


class PhaseTimers:
    """Accumulates wall time per named phase within the current engine step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start

        return timed


@contextmanager
def instrumented(llm: LLM, records: list[StepRecord]) -> Iterator[None]:
    """Times the phases of every engine step while the block runs; restores everything after."""
    engine, runner = llm.engine, llm.engine.runner
    timers = PhaseTimers()
    instance_patches: list[tuple[Any, str, str]] = [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "prepare", "prepare"),
        (runner, "execute", "execute"),
        (runner.model, "forward", "forward"),
        (runner.model, "compute_logits", "logits"),
        (engine.backend, "forward", "attention"),
        (runner, "sampler", "sampler"),
        (engine.scheduler, "update_after_step", "update"),
        (engine, "_append_token", "append_token"),
    ]
    class_patches: list[tuple[type, str, str]] = [
        (IncrementalDetokenizer, "append", "detokenize"),
        (RequestState, "make_output", "make_output"),
    ]
    originals_from_seqs = SamplingBatch.__dict__["from_seqs"]
    originals_class = [(cls, attr, cls.__dict__[attr]) for cls, attr, _ in class_patches]
    # Instance attributes that exist (runner.sampler) are put back; wrappers of methods are just deleted.
    originals_instance = [(obj, attr, vars(obj).get(attr, _MISSING)) for obj, attr, _ in instance_patches]
    for obj, attr, name in instance_patches:
        setattr(obj, attr, timers.wrap(name, getattr(obj, attr)))
    for cls, attr, name in class_patches:
        setattr(cls, attr, timers.wrap(name, cls.__dict__[attr]))
    SamplingBatch.from_seqs = staticmethod(timers.wrap("from_seqs", SamplingBatch.from_seqs))  # type: ignore[method-assign]

    last: list[StepStats] = []

    def listener(stats: StepStats, _outputs: object) -> None:
        last.append(stats)

    engine.step_listeners.append(listener)
    original_step = engine.step

    def step() -> Any:
        timers.current.clear()
        last.clear()
        start = time.perf_counter()
        outputs = original_step()
        total = time.perf_counter() - start
        if last:
            records.append(StepRecord(last[-1], total, dict(timers.current)))
        return outputs

    engine.step = step  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine.step
        engine.step_listeners.remove(listener)
        for obj, attr, original in originals_instance:
            if original is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, original)
        for cls, attr, original in originals_class:
            setattr(cls, attr, original)
        SamplingBatch.from_seqs = originals_from_seqs  # type: ignore[method-assign]


def breakdown(records: list[StepRecord]) -> dict[str, dict[str, Any]]:
    groups = {
        "all steps": records,
        "decode only": [r for r in records if r.kind == "decode only"],
        "with prefill": [r for r in records if r.kind == "with prefill"],
    }
    out: dict[str, dict[str, Any]] = {}
    for label, group in groups.items():
        if not group:
            continue
        total = sum(r.total_s for r in group)
        sums = {p: sum(r.phases()[p] for r in group) for p in PHASES}
        out[label] = {
            "steps": len(group),
            "total_s": total,
            "mean_step_ms": 1e3 * total / len(group),
            "mean_seqs": statistics.fmean(r.stats.num_seqs for r in group),
            "mean_tokens": statistics.fmean(r.stats.num_scheduled_tokens for r in group),
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


def op_profile(llm: LLM, workload: Workload) -> dict[str, list[dict[str, Any]]]:
    """torch.profiler over the first step and a few decode-only steps (with many sequences) of ``workload``."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(f"prof-{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    totals: dict[str, dict[str, dict[str, float]]] = {"first step": {}, "decode only": {}}
    counts = {"first step": 0, "decode only": 0}
    min_decode_seqs = max(1, min(32, workload.num_requests // 2))
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        decode_only = not sched.waiting and all(s.num_uncomputed_tokens == 1 for s in sched.running)
        label = None
        if counts["first step"] == 0:
            label = "first step"
        elif decode_only and len(sched.running) >= min_decode_seqs and counts["decode only"] < PROFILED_DECODE_STEPS:
            label = "decode only"
        if label is None:
            if counts["decode only"] >= PROFILED_DECODE_STEPS:
                engine.abort_request(list(engine.requests))  # seen enough: skip the rest of the workload
                break
            engine.step()
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        counts[label] += 1
        for event in prof.key_averages():
            entry = totals[label].setdefault(event.key, {"self_us": 0.0, "calls": 0})
            entry["self_us"] += event.self_cpu_time_total
            entry["calls"] += event.count
    result: dict[str, list[dict[str, Any]]] = {}
    for label, ops in totals.items():
        if not counts[label]:
            continue
        total = sum(op["self_us"] for op in ops.values())
        ranked = sorted(ops.items(), key=lambda kv: -kv[1]["self_us"])
        result[label] = [
            {
                "op": name,
                "self_ms_per_step": op["self_us"] / 1e3 / counts[label],
                "share": op["self_us"] / total,
                "calls_per_step": op["calls"] / counts[label],
            }
            for name, op in ranked[:TOP_OPS]
        ]
        log("")
        log(f"== torch.profiler, {label} ({counts[label]} step(s)): top ops by self CPU time ==")
        for row in result[label]:
            log(
                f"    {row['op']:40s} {row['self_ms_per_step']:9.2f} ms/step {row['share']:6.1%}"
                f" {row['calls_per_step']:8.0f} calls/step"
            )
    return result


def main() -> dict[str, Any]:
    args = parse_args()
    log(f"profile_step, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}")
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    llm = LLM(**engine_kwargs(args))
    workload = make_workload(llm.engine.tokenizer, args.num_requests, args.seed)
    log(f"workload: {json.dumps(workload.summary())}")
    warmup = workload.prompts[0][:16]
    llm.generate([warmup], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.engine.block_manager.reset_prefix_cache()

    records: list[StepRecord] = []
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    with instrumented(llm, records), Timer() as timer:
        llm.generate(workload.prompts, params, use_tqdm=False)
    log(
        f"instrumented run: {workload.output_tokens} generated tokens in {timer.wall_s:.1f} s "
        f"({workload.output_tokens / timer.wall_s:.1f} tok/s), foreign CPU share {timer.foreign_cpu_share}"
    )
    table = breakdown(records)
    print_breakdown(table)

    ops = op_profile(llm, make_workload(llm.engine.tokenizer, args.num_requests, args.seed + 1))
    out = {
        "command": " ".join(sys.argv),
        "workload": workload.summary(),
        "wall_s": timer.wall_s,
        **timer.to_json(),
        "breakdown": table,
        "ops": ops,
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
