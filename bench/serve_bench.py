"""Serving benchmark: a seeded workload against a running OpenAI-compatible endpoint, like vLLM's
``benchmark_serving.py``, and the same arrival trace served by a plain HF transformers loop, in one run.

The workload is the offline benchmark's (``throughput.make_workload``: real-text prompts of uniform length
in [32, 512] tokens, output lengths uniform in [16, 256], fixed by ``--seed``), sent as token-id prompts to
``/v1/completions`` with ``ignore_eos`` so every request generates exactly its output length
(``--max-output-len`` caps the lengths for shorter runs). Requests arrive as a Poisson process at
``--request-rate`` per second (``inf``: all at once; the arrival times are fixed by ``--seed`` and each
request is sent at its time after the start, so the trace does not drift), at most ``--max-concurrency`` in
flight, and stream their tokens (server-sent events, read with httpx).

Per request: TTFT (time to the first token's chunk), ITL (the gaps between later chunks; one chunk per
token), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency. Reported: request and token
throughput over the benchmark's wall time, and mean / p50 / p90 / p99 of each latency.

Systems (``--systems``, default both, in this order, never overlapping):
  cb-serve  the server at ``--base-url``. With both systems ``--launch CONFIG`` is required: the server is
            started here, and stopped (waiting up to 60 s for all of its processes to exit, warning if
            some do not) before the HF baseline starts. Against an external server run
            ``--systems cb-serve``, stop the server, then ``--systems hf``.
  hf        HF transformers serving the SAME trace (same requests, same seeded arrival times, same token-id
            prompts and output lengths, greedy, EOS ignored) in this process, the way a plain HF server
            would: one worker that, whenever it is free, takes the requests that have arrived and wait (at
            most ``--hf-batch-size``, default 16 like ``throughput.py``'s static batches, in arrival order)
            and runs ``model.generate`` on them as one static left-padded batch with ``max_new_tokens`` = the
            batch's longest output; requests arriving meanwhile wait for the next batch. A ``BaseStreamer``
            timestamps each generation step, which gives each request its token times (only up to its own
            output length): TTFT from its arrival time in the trace, ITL, TPOT and end-to-end latency,
            summarized by the same code as cb-serve's. The model is loaded like ``throughput.load_hf_model``
            (float32, the same model source as ``--hf-model``, by default the built-in GGUF model) with
            ``--hf-threads`` torch threads (default: what the cb-serve replica gets from the config: its
            ``engine.num_threads``, else Ray's ``OMP_NUM_THREADS`` = floor of its ``num_cpus``, i.e. 1 for
            ``deploy/config.yaml``).

What the HF baseline is not: it has no HTTP server, no tokenization/detokenization, no network and no
other processes (cb-serve's numbers include the proxy, the router and SSE streaming, measured at the
client), so it is favoured there; its timestamps are taken when ``generate`` hands a step's tokens to the
streamer. It is also not HF's best possible server: no continuous batching (see ``throughput.py``'s
hf-continuous for that offline), no request preemption, and one batch at a time (a request that arrives
while a batch runs waits for the whole batch, including the other requests' longer outputs). With
``--max-concurrency``, cb-serve's TTFT counts from when the client sends a request (its client-side wait is
``queue_s``), while HF ignores the limit and counts from the arrival.

cb-serve's engine scheduling + batch-building share of the step time is not obtainable from the server:
the ``cb_serve_*`` metrics (``cb_serve/serve/metrics.py``, scraped from Ray's metrics export port, not
served by the router) have batch fill and sequences per step but no step-phase timings, and ``StepStats``
holds only each step's total ``duration_s``; ``bench/profile_step.py`` measures the breakdown offline.
What ``/stats`` gives (steps, tokens, preemptions during the run) is recorded.

``--json``: ``results`` and ``requests`` per system, ``comparison`` (the final table), ``cb_serve_engine``
(the ``/stats`` deltas), ``hf`` (its batches: sizes, start times, padding, wasted decode tokens).

Run from the repository root:
    .venv/bin/python bench/serve_bench.py --launch deploy/config.yaml --num-requests 32   # cb-serve, then HF
    .venv/bin/python bench/serve_bench.py --launch deploy/config.yaml --skip-hf           # cb-serve only
    .venv/bin/python bench/serve_bench.py --base-url http://127.0.0.1:8000/v1 --systems cb-serve --json out.json
    .venv/bin/python bench/serve_bench.py --systems hf --request-rate 1                  # HF only, no server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import yaml
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (
    HF_STATIC_BATCH_SIZE,
    Workload,
    _busy_cpu_seconds,
    cb_serve_source,
    eos_disabled,
    hf_static_batch,
    load_hf_model,
    log,
    make_workload,
    warmup_prompt,
    write_json,
)

from cb_serve.model_executor import loader

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "deploy" / "config.yaml"
PERCENTILES = (50, 90, 99)
SYSTEMS = ("cb-serve", "hf")
ENGINE_DEPLOYMENT = "EngineReplica"
CONTENTION_WARNING = 0.05  # foreign CPU share above which a measurement is flagged
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
SCHEDULING_SHARE_NOTE = (
    "scheduling_seconds / step_seconds from the engine's /stats counters over the timed run "
    "(scheduling + building the batch's tensors, of the wall time inside engine steps)"
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


# ---- one request -------------------------------------------------------------------------------------------------
async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int, headers: dict[str, str]
) -> RequestResult:
    result = RequestResult(len(prompt), max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.latency_s = time.perf_counter() - start
        result.ok = result.completion_tokens == max_tokens
        if not result.ok:
            result.error = f"{result.completion_tokens} tokens generated, {max_tokens} requested"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


# ---- the trace -----------------------------------------------------------------------------------------------------
def arrival_gaps(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds between consecutive arrivals (the first: after the start): exponential gaps (a Poisson
    process) at ``rate``/s."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num_requests)]


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Each request's arrival, seconds after the start: the trace both systems serve."""
    return list(accumulate(arrival_gaps(num_requests, rate, seed)))


def capped_output_lens(workload: Workload, max_output_len: int) -> list[int]:
    return [min(n, max_output_len) for n in workload.output_lens]


# ---- 1. cb-serve over HTTP -----------------------------------------------------------------------------------------
async def get_engine_stats(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """The engine counters of ``/stats`` (one replica), or None."""
    try:
        response = await client.get(f"{server_root(base_url)}/stats", headers=headers, timeout=30)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, json.JSONDecodeError):
        return None


def engine_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """What the engine did during the timed run, from two ``/stats`` snapshots."""
    out: dict[str, Any] = {"scheduling_share": None, "scheduling_share_note": SCHEDULING_SHARE_NOTE}
    if before is None or after is None:
        return {**out, "stats": "unavailable (/stats did not answer)"}
    for key in ("num_steps", "prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_hits",
                "step_seconds", "scheduling_seconds"):  # fmt: skip
        if isinstance(before.get(key), (int, float)) and isinstance(after.get(key), (int, float)):
            out[key] = after[key] - before[key]
    if out.get("step_seconds"):
        out["scheduling_share"] = out.get("scheduling_seconds", 0.0) / out["step_seconds"]
    if out.get("num_steps"):
        out["mean_generated_tokens_per_step"] = out.get("generation_tokens", 0) / out["num_steps"]
    out["max_batch_seqs_since_start"] = after.get("max_batch_seqs")
    return out


async def run_benchmark(
    args: argparse.Namespace, model: str, workload: Workload, arrivals: Sequence[float]
) -> tuple[float, list[RequestResult], dict[str, Any]]:
    url = f"{args.base_url}/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"}
    output_lens = capped_output_lens(workload, args.max_output_len)
    limit = args.max_concurrency or workload.num_requests
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit + 1)) as client:
        for _ in range(args.warmup):  # not timed: first-request costs (allocations, kernel builds) stay out
            warm = await stream_completion(client, url, model, warmup_prompt(workload), 8, headers)
            if not warm.ok:
                raise SystemExit(f"warmup request failed: {warm.error}")
        stats_before = await get_engine_stats(client, args.base_url, headers)
        semaphore = asyncio.Semaphore(limit)
        start = time.perf_counter()

        async def one(prompt: list[int], max_tokens: int, arrival: float) -> RequestResult:
            async with semaphore:
                sent = time.perf_counter() - start
                result = await stream_completion(client, url, model, prompt, max_tokens, headers)
            result.arrival_s, result.queue_s = arrival, max(0.0, sent - arrival)
            return result

        tasks = []
        for prompt, max_tokens, arrival in zip(workload.prompts, output_lens, arrivals):
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(one(prompt, max_tokens, arrival)))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
        stats_after = await get_engine_stats(client, args.base_url, headers)
    return duration_s, list(results), engine_delta(stats_before, stats_after)


# ---- 2. HF transformers serving the same trace ---------------------------------------------------------------------
class StepClock(BaseStreamer):
    """``generate()`` streamer: the time and the batch's new tokens of every generation step. ``generate``
    first puts the prompt ids (2-D, skipped), then once per step the step's tokens (1-D, one per row)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if value.dim() != 1:
            return
        self.times.append(now)
        self.tokens.append(value.tolist())

    def end(self) -> None:
        pass


def hf_generate(
    model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, streamer: StepClock
) -> list[list[int]]:
    """``throughput.hf_static_batch`` with a step clock; checks that the clock saw every step and token."""
    new = hf_static_batch(model, prompts, max_new_tokens, pad_id, streamer).tolist()
    if len(streamer.times) != max_new_tokens or any(len(row) != max_new_tokens for row in new):
        raise RuntimeError(f"hf: {len(streamer.times)} steps streamed, {max_new_tokens} tokens expected")
    if [list(step) for step in zip(*new)] != streamer.tokens:
        raise RuntimeError("hf: the streamed tokens differ from generate()'s output")
    return new


@torch.inference_mode()
def run_hf(
    args: argparse.Namespace, workload: Workload, arrivals: Sequence[float]
) -> tuple[float, list[RequestResult], dict[str, Any]]:
    """The trace through one HF worker taking the arrived requests as static batches (module docstring)."""
    torch.set_num_threads(args.hf_threads)
    source = loader.resolve_model_source(args.hf_model)
    load_start = time.perf_counter()
    model = load_hf_model(source, torch.float32)
    tokenizer = loader.load_tokenizer(source)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    log(f"[hf] {source.name} loaded in {time.perf_counter() - load_start:.1f} s (float32, {torch.get_num_threads()} "
        f"torch threads), batches of at most {args.hf_batch_size}")  # fmt: skip
    output_lens = capped_output_lens(workload, args.max_output_len)
    results = [RequestResult(len(p), n, arrival_s=a) for p, n, a in zip(workload.prompts, output_lens, arrivals)]
    batches: list[dict[str, Any]] = []
    with eos_disabled(model):
        for _ in range(args.warmup):  # untimed, like cb-serve's warmup request
            hf_generate(model, [warmup_prompt(workload)], 8, pad_id, StepClock())
        n, taken = workload.num_requests, 0
        start = time.perf_counter()
        while taken < n:
            wait = start + arrivals[taken] - time.perf_counter()
            if wait > 0:  # idle until the next request arrives
                time.sleep(wait)
            now = time.perf_counter() - start
            batch = [taken]
            while taken + len(batch) < n and len(batch) < args.hf_batch_size and arrivals[taken + len(batch)] <= now:
                batch.append(taken + len(batch))
            taken += len(batch)
            prompts, lens = [workload.prompts[i] for i in batch], [output_lens[i] for i in batch]
            clock = StepClock()
            batch_start = time.perf_counter() - start
            hf_generate(model, prompts, max(lens), pad_id, clock)
            for i, own_len in zip(batch, lens):
                r, times = results[i], [t - start for t in clock.times[:own_len]]
                r.queue_s, r.batch_size = batch_start - r.arrival_s, len(batch)
                r.ttft_s, r.latency_s = times[0] - r.arrival_s, times[-1] - r.arrival_s
                r.itl_s = [b - a for a, b in zip(times, times[1:])]
                r.completion_tokens, r.ok = len(times), len(times) == r.output_len
            batches.append({
                "size": len(batch), "start_s": batch_start, "wall_s": clock.times[-1] - start - batch_start,
                "max_new_tokens": max(lens), "padded_prompt_len": max(len(p) for p in prompts),
                "padding_tokens": sum(max(len(p) for p in prompts) - len(p) for p in prompts),
                "wasted_decode_tokens": sum(max(lens) - k for k in lens),
            })  # fmt: skip
        duration_s = time.perf_counter() - start
    sizes = [b["size"] for b in batches]
    info = {
        "model": source.name,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "batch_size_limit": args.hf_batch_size,
        "num_batches": len(batches),
        "mean_batch_size": float(np.mean(sizes)),
        "max_batch_size": max(sizes),
        "wasted_decode_tokens": sum(b["wasted_decode_tokens"] for b in batches),
        "padding_tokens": sum(b["padding_tokens"] for b in batches),
        "batches": batches,
    }
    log(f"[hf] {len(batches)} batches, sizes {sizes}")
    return duration_s, results, info


# ---- statistics (one code path for both systems) ------------------------------------------------------------------
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
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "end-to-end"),
                        ("queue", "queue (arrival to service)")):  # fmt: skip
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


# ---- CPU contention ----------------------------------------------------------------------------------------------
def _proc_stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds incl. waited-for children) of every process (Linux ``/proc``)."""
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


def descendants(roots: Sequence[int], stats: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """``roots`` (those alive) and their live descendants."""
    stats = _proc_stats() if stats is None else stats
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
    stats = _proc_stats()
    return sum(stats[pid][1] for pid in descendants(roots, stats))


class Contention:
    """Share of the machine's CPU (0 = none, 1 = all cores) that processes outside ``roots`` and their
    descendants used meanwhile; None for ``roots=None`` (an external server's processes are not ours to
    tell apart)."""

    def __init__(self, roots: Sequence[int] | None) -> None:
        self.roots = list(roots or [])
        self.enabled = roots is not None and _busy_cpu_seconds() is not None

    def __enter__(self) -> Contention:
        if self.enabled:
            self._busy, self._ours, self._start = _busy_cpu_seconds(), tree_cpu_seconds(self.roots), time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.foreign_cpu_share: float | None = None
        if self.enabled:
            wall = time.time() - self._start
            ours = tree_cpu_seconds(self.roots) - self._ours
            foreign = max(0.0, _busy_cpu_seconds() - self._busy - ours)
            self.foreign_cpu_share = foreign / (wall * (os.cpu_count() or 1))


# ---- the server ----------------------------------------------------------------------------------------------------
def server_root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def server_answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{server_root(base_url)}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until_ready(base_url: str, api_key: str, timeout_s: float, proc: subprocess.Popen | None = None) -> str:
    """Waits for /health and /v1/models; returns the served model's name."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"}
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{server_root(base_url)}/health", timeout=5).status_code == 200:
                models = httpx.get(f"{base_url}/models", headers=headers, timeout=30)
                if models.status_code == 200:
                    return models.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"the server at {base_url} was not ready within {timeout_s:.0f} s")


def launch(config: str, log_path: Path) -> subprocess.Popen:
    """``serve run CONFIG`` in its own process group, output to ``log_path``."""
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log(f"launching `serve run {config}` (log: {log_path})")
    with open(log_path, "w") as out:
        return subprocess.Popen([serve_bin, "run", config], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen, wait_for_tree_s: float = 60.0) -> list[int]:
    """Ctrl-C to ``serve run`` (it shuts Serve and its Ray instance down), then harder if it hangs; then
    waits for the processes it had started to be gone. Returns the pids still alive after that."""
    tree = descendants([proc.pid])
    for sig, wait_s in ((signal.SIGINT, 90), (signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            log(f"`serve run` did not stop on {sig.name}")
    deadline = time.monotonic() + wait_for_tree_s
    while True:
        alive = [pid for pid in tree if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(1)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def replica_threads(config_path: Path) -> tuple[int, str]:
    """Torch threads of the cb-serve engine replica that ``config_path`` deploys, and why: the engine's
    ``num_threads``, else the ``OMP_NUM_THREADS`` the replica inherits or Ray sets (floor of its num_cpus,
    at least 1; Serve reserves 1 CPU per replica by default)."""
    try:
        app = yaml.safe_load(config_path.read_text())["applications"][0]
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError) as e:
        return 1, f"{config_path} unreadable ({type(e).__name__}); assumed 1"
    app_args = app.get("args") or {}
    if (app_args.get("engine") or {}).get("num_threads"):
        return int(app_args["engine"]["num_threads"]), f"engine.num_threads in {config_path}"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS of this environment (the replica inherits it)"
    options = (
        next(
            (d.get("ray_actor_options") for d in app.get("deployments") or [] if d.get("name") == ENGINE_DEPLOYMENT),
            None,
        )
        or (app_args.get("engine_replica") or {}).get("ray_actor_options")
        or {}
    )
    num_cpus = options.get("num_cpus", 1)
    return max(
        math.floor(num_cpus), 1
    ), f"{ENGINE_DEPLOYMENT} num_cpus {num_cpus} in {config_path} (Ray's OMP_NUM_THREADS)"


# ---- main ----------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI API base URL.")
    parser.add_argument("--model", help="Model name to request (default: the first of /v1/models).")
    parser.add_argument("--api-key", default=os.environ.get("CB_SERVE_API_KEY", "none"), help="Bearer key.")
    parser.add_argument("--tokenizer", default="default", help="Tokenizer for the prompts (default: built-in model's).")
    parser.add_argument("--num-requests", type=int, default=64, help="Number of requests (default: 64).")
    parser.add_argument("--seed", type=int, default=0, help="Workload and arrival-time seed (default: 0).")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Requests/s, Poisson (default: inf).")
    parser.add_argument("--max-concurrency", type=int, help="Most requests in flight (default: no limit).")
    parser.add_argument("--max-output-len", type=int, default=1 << 30, help="Cap on each output length.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed requests first (default: 1).")
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="Seconds per request.")
    parser.add_argument("--launch", metavar="CONFIG", help="Start `serve run CONFIG` first and stop it after.")
    parser.add_argument("--launch-timeout", type=float, default=600.0, help="Seconds to wait for the server.")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="Comma-separated: cb-serve,hf (default: both).")
    parser.add_argument("--skip-hf", action="store_true", help="Only cb-serve (same as --systems cb-serve).")
    parser.add_argument("--hf-model", default="default", help="HF baseline's model (default: the built-in one).")
    parser.add_argument("--hf-batch-size", type=int, default=HF_STATIC_BATCH_SIZE, help="HF's largest batch.")
    parser.add_argument(
        "--hf-threads",
        type=int,
        help="HF's torch threads (default: the cb-serve replica's, from --launch's config or deploy/config.yaml).",
    )
    parser.add_argument("--json", metavar="OUT", help="Write config, per-request records and results to OUT.")
    args = parser.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    args.systems = ["cb-serve"] if args.skip_hf else [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)} (got {', '.join(unknown) or 'none'})")
    args.systems = [s for s in SYSTEMS if s in args.systems]  # cb-serve first, then HF: never overlapping
    if "hf" in args.systems:
        if args.hf_threads is None:
            args.hf_threads, args.hf_threads_source = replica_threads(Path(args.launch or DEFAULT_CONFIG))
        else:
            args.hf_threads_source = "--hf-threads"
        if "cb-serve" in args.systems and not args.launch:
            parser.error("HF and cb-serve must not run at the same time: with both systems use --launch CONFIG "
                         "(the server is stopped before HF runs), or run --systems cb-serve and --systems hf "
                         "separately with the server stopped in between")  # fmt: skip
    return args


def run_cb_serve(args: argparse.Namespace, workload: Workload, arrivals: Sequence[float]) -> dict[str, Any]:
    if args.launch and server_answers(args.base_url):
        raise SystemExit(f"something already answers at {server_root(args.base_url)}/health; stop it or pass "
                         "another --base-url (matching the config's port) before --launch")  # fmt: skip
    log_path = Path(args.json or "serve_bench").with_suffix(".server.log")
    proc = launch(args.launch, log_path) if args.launch else None
    leftover: list[int] = []
    try:
        served = wait_until_ready(args.base_url, args.api_key, args.launch_timeout, proc)
        model = args.model or served
        log(f"[cb-serve] ready, model {model}; rate {args.request_rate}/s, concurrency {args.max_concurrency or 'any'}")
        with Contention(None if proc is None else [os.getpid(), proc.pid]) as contention:
            duration_s, results, engine = asyncio.run(run_benchmark(args, model, workload, arrivals))
    finally:
        if proc is not None:
            leftover = stop(proc)
            if leftover:
                log(f"WARNING: processes of `serve run` still alive after stopping it: {leftover}")
            else:
                log("[cb-serve] server stopped, all of its processes gone")
    summary = {**summarize(duration_s, results), "foreign_cpu_share": contention.foreign_cpu_share}
    return {"summary": summary, "requests": results, "engine": engine, "server_leftover_pids": leftover}


def run_hf_system(args: argparse.Namespace, workload: Workload, arrivals: Sequence[float]) -> dict[str, Any]:
    if server_answers(args.base_url):
        log(f"WARNING: a server answers at {server_root(args.base_url)} while the HF baseline runs")
    if args.max_concurrency:
        log("NOTE: the HF baseline ignores --max-concurrency (its batch size limits it; its TTFT counts queueing)")
    log(f"[hf] torch threads {args.hf_threads} ({args.hf_threads_source})")
    with Contention([os.getpid()]) as contention:
        duration_s, results, info = run_hf(args, workload, arrivals)
    summary = {**summarize(duration_s, results), "foreign_cpu_share": contention.foreign_cpu_share}
    return {"summary": summary, "requests": results, "hf": info}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    loadavg_before = os.getloadavg()  # the machine should be otherwise idle; this is a hint whether it was
    log(f"serving benchmark, {started}: {' '.join(sys.argv)}")
    log(f"systems: {', '.join(args.systems)}")
    tokenizer = loader.load_tokenizer(loader.resolve_model_source(args.tokenizer))
    workload = make_workload(tokenizer, args.num_requests, args.seed)
    arrivals = arrival_times(workload.num_requests, args.request_rate, args.seed)
    log(f"workload: {json.dumps(workload.summary())} (outputs capped at {args.max_output_len}); "
        f"arrivals over {arrivals[-1]:.1f} s")  # fmt: skip

    runs: dict[str, dict[str, Any]] = {}
    if "cb-serve" in args.systems:
        runs["cb-serve"] = run_cb_serve(args, workload, arrivals)
        log("[cb-serve] results:\n" + table(runs["cb-serve"]["summary"]))
        engine = runs["cb-serve"]["engine"]
        counters = {k: v for k, v in engine.items() if "note" not in k}
        log(f"[cb-serve] engine during the run (/stats): {json.dumps(counters)}")
        share = engine.get("scheduling_share")
        log(f"[cb-serve] scheduling + batch-building share of step time: "
            f"{'n/a' if share is None else f'{share:.2%}'} ({SCHEDULING_SHARE_NOTE})")  # fmt: skip
    if "hf" in args.systems:
        runs["hf"] = run_hf_system(args, workload, arrivals)
        log("[hf] results:\n" + table(runs["hf"]["summary"]))

    summaries = {name: run["summary"] for name, run in runs.items()}
    comp = comparison(summaries)
    log("\ncomparison (same trace; cb-serve advantage = cb-serve / HF for throughputs, HF / cb-serve for latencies):")
    log(comparison_table(comp, list(runs)))
    for name, s in summaries.items():
        share = s["foreign_cpu_share"]
        if share is not None:
            log(f"foreign CPU share during {name}: {share:.1%} (0 = the machine was ours)")
            if share > CONTENTION_WARNING:
                log(f"WARNING: other processes kept {share:.0%} of the CPUs busy during {name}; rerun when idle")
    out = {
        "started": started,
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cb_serve": cb_serve_source(),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "config": {k: str(v) if v == math.inf else v for k, v in vars(args).items() if k != "api_key"},
        "workload": {
            **workload.summary(),
            "output_tokens_capped": sum(capped_output_lens(workload, args.max_output_len)),
            "arrival_s": arrivals,
        },
        "results": summaries,
        "comparison": comp,
        **({"cb_serve_engine": runs["cb-serve"]["engine"]} if "cb-serve" in runs else {}),
        **({"hf": runs["hf"]["hf"]} if "hf" in runs else {}),
        "requests": {name: [asdict(r) for r in run["requests"]] for name, run in runs.items()},
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
