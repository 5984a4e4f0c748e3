"""Chrome trace-event JSON of an engine's recent steps and requests (opens in Perfetto UI and
chrome://tracing): one process per replica, steps as complete slices on one track, KV blocks
and batch tokens as counters, and each request as an async slice with its phases nested
(queued, prefill, decode) and preemptions as instants."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from cb_serve.engine.inspector import RequestTimeline, StepRecord


def _us(t: float) -> int:
    return int(t * 1_000_000)


def trace_events(
    steps: Iterable[StepRecord], timelines: Iterable[RequestTimeline], since: float, pid: int = 1, name: str = "engine"
) -> list[dict[str, Any]]:
    """Events of the steps and requests that end at or after ``since`` (wall-clock seconds)."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"replica {name}"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "engine steps"}},
    ]
    for r in steps:
        decode = sum(s.num_tokens for s in r.seqs if s.is_decode)
        args = {
            "scheduled_tokens": r.num_scheduled_tokens,
            "token_budget": r.token_budget,
            "prefill_tokens": r.num_scheduled_tokens - decode,
            "decode_tokens": decode,
            "seqs": len(r.seqs),
            "admitted": len(r.admitted),
            "preempted": len(r.preempted),
            "finished": len(r.finished),
            "constrained": sum(s.constrained for s in r.seqs),
            "grammar_fill_s": r.grammar_fill_s,
            "grammar_wait_s": r.grammar_wait_s,
            "image_tokens": sum(s.image_tokens for s in r.seqs),
            "images_encoded": r.images_encoded,
            "encoder_s": r.encoder_s,
        }
        ts = _us(r.start)
        events.append(
            {
                "name": f"step {r.step_id}",
                "cat": "step",
                "ph": "X",
                "ts": ts,
                "dur": max(1, _us(r.duration_s)),
                "pid": pid,
                "tid": 0,
                "args": args,
            }  # fmt: skip
        )
        tokens = {"prefill": args["prefill_tokens"], "decode": decode}
        events.append({"name": "batch tokens", "ph": "C", "ts": ts, "pid": pid, "args": tokens})
        kv = {"used": r.kv_used, "cached_free": r.kv_cached_free, "free": r.kv_free - r.kv_cached_free}
        events.append({"name": "kv blocks", "ph": "C", "ts": ts, "pid": pid, "args": kv})
    now = time.time()
    for tl in timelines:
        end = tl.finished if tl.finished is not None else now
        if end < since:
            continue
        events += _request_events(tl, end, pid)
    return events


def _request_events(tl: RequestTimeline, end: float, pid: int) -> list[dict[str, Any]]:
    """A request's async slice with its phases nested in it, each begin matched by an end."""
    common = {"cat": "request", "id": tl.request_id, "pid": pid, "tid": 0}
    scheduled = next((e["t"] for e in tl.events if e["event"] == "scheduled"), None)
    first_token = tl.first_token
    reasons = ",".join(sorted(set(tl.finish_reasons.values()))) or "unfinished"
    args = {"prompt_tokens": tl.num_prompt_tokens, "finish": reasons}
    spans = [(f"request {tl.request_id}", tl.arrival, end, args)]
    spans.append(("queued", tl.arrival, min(scheduled if scheduled is not None else end, end), {}))
    if scheduled is not None:
        spans.append(("prefill", scheduled, min(first_token if first_token is not None else end, end), {}))
    if first_token is not None:
        spans.append(("decode", first_token, end, {}))
    out: list[dict[str, Any]] = []
    for name, t0, _, span_args in spans:
        out.append({**common, "name": name, "ph": "b", "ts": _us(t0), "args": span_args})
    for e in tl.events:
        if e["event"] in ("preempted", "readmitted"):
            out.append({**common, "name": e["event"], "ph": "n", "ts": _us(e["t"]), "args": {"step": e["step"]}})
    for name, _, t1, _ in reversed(spans):  # innermost first: nested ends close in order
        out.append({**common, "name": name, "ph": "e", "ts": _us(max(t1, tl.arrival))})
    return out
