"""Serving benchmark: a seeded workload against a running OpenAI-compatible endpoint, like vLLM's
``benchmark_serving.py``.

The workload is the offline benchmark's (``throughput.make_workload``: real-text prompts of uniform length
in [32, 512] tokens, output lengths uniform in [16, 256], fixed by ``--seed``), sent as token-id prompts to
``/v1/completions`` with ``ignore_eos`` so every request generates exactly its output length
(``--max-output-len`` caps the lengths for shorter runs). Requests arrive as a Poisson process at
``--request-rate`` per second (``inf``: all at once), at most ``--max-concurrency`` in flight, and stream
their tokens (server-sent events, read with httpx).

Per request: TTFT (time to the first token's chunk), ITL (the gaps between later chunks; one chunk per
token), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency. Reported: request and token
throughput over the benchmark's wall time, and mean / p50 / p90 / p99 of each latency.

Run from the repository root:
    .venv/bin/python bench/serve_bench.py --launch deploy/config.yaml --num-requests 32   # starts + stops the server
    .venv/bin/python bench/serve_bench.py --base-url http://127.0.0.1:8000/v1 --request-rate 4 --json out.json
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
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (
    Workload,
    _busy_cpu_seconds,
    cb_serve_source,
    log,
    make_workload,
    warmup_prompt,
    write_json,
)

from cb_serve.model_executor import loader

ROOT = Path(__file__).resolve().parent.parent
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # requested
    ok: bool = False
    completion_tokens: int = 0  # as the server's usage reports them
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


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


# ---- the run -----------------------------------------------------------------------------------------------------
def arrival_gaps(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process) at ``rate``/s."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num_requests)]


async def run_benchmark(args: argparse.Namespace, model: str, workload: Workload) -> tuple[float, list[RequestResult]]:
    url = f"{args.base_url}/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"}
    output_lens = [min(n, args.max_output_len) for n in workload.output_lens]
    limit = args.max_concurrency or workload.num_requests
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit + 1)) as client:
        for _ in range(args.warmup):  # not timed: first-request costs (allocations, kernel builds) stay out
            warm = await stream_completion(client, url, model, warmup_prompt(workload), 8, headers)
            if not warm.ok:
                raise SystemExit(f"warmup request failed: {warm.error}")
        semaphore = asyncio.Semaphore(limit)

        async def one(prompt: list[int], max_tokens: int) -> RequestResult:
            async with semaphore:
                return await stream_completion(client, url, model, prompt, max_tokens, headers)

        tasks = []
        gaps = arrival_gaps(workload.num_requests, args.request_rate, args.seed)
        start = time.perf_counter()
        for prompt, max_tokens, gap in zip(workload.prompts, output_lens, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        return time.perf_counter() - start, list(results)


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
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "end-to-end")):
        d = summary[name]
        latency.append(f"| {label} | {d['mean_ms']:.1f} | " + " | ".join(f"{d[f'p{p}_ms']:.1f}" for p in PERCENTILES))
        latency[-1] += " |"
    return "\n".join(head + lines + latency)


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


def tree_cpu_seconds(roots: Sequence[int]) -> float:
    """CPU seconds of ``roots`` and their live descendants (the client, `serve run` and its Ray processes)."""
    stats = _proc_stats()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [r for r in roots if r in stats]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


class Contention:
    """Share of the machine's CPU (0 = none, 1 = all cores) that processes outside the benchmark used while
    it ran; measured only with ``--launch`` (an external server's processes are not ours to tell apart)."""

    def __init__(self, proc: subprocess.Popen | None) -> None:
        self.roots = [os.getpid()] + ([proc.pid] if proc is not None else [])
        self.enabled = proc is not None and _busy_cpu_seconds() is not None

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


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to ``serve run`` (it shuts Serve and its Ray instance down), then harder if it hangs."""
    for sig, wait_s in ((signal.SIGINT, 90), (signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            log(f"`serve run` did not stop on {sig.name}")


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
    parser.add_argument("--json", metavar="OUT", help="Write config, per-request records and results to OUT.")
    args = parser.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    loadavg_before = os.getloadavg()  # the machine should be otherwise idle; this is a hint whether it was
    log(f"serving benchmark, {started}: {' '.join(sys.argv)}")
    tokenizer = loader.load_tokenizer(loader.resolve_model_source(args.tokenizer))
    workload = make_workload(tokenizer, args.num_requests, args.seed)
    log(f"workload: {json.dumps(workload.summary())} (outputs capped at {args.max_output_len})")
    proc = launch(args.launch, Path(args.json or "serve_bench").with_suffix(".server.log")) if args.launch else None
    try:
        served = wait_until_ready(args.base_url, args.api_key, args.launch_timeout, proc)
        model = args.model or served
        log(f"server ready, model {model}; rate {args.request_rate}/s, concurrency {args.max_concurrency or 'any'}")
        with Contention(proc) as contention:
            duration_s, results = asyncio.run(run_benchmark(args, model, workload))
    finally:
        if proc is not None:
            stop(proc)
    summary = {**summarize(duration_s, results), "foreign_cpu_share": contention.foreign_cpu_share}
    log(table(summary))
    if contention.foreign_cpu_share is not None:
        log(f"foreign CPU share during the run: {contention.foreign_cpu_share:.1%} (0 = the machine was ours)")
    out = {
        "started": started,
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "cb_serve": cb_serve_source(),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "config": {k: str(v) if v == math.inf else v for k, v in vars(args).items() if k != "api_key"},
        "workload": {
            **workload.summary(),
            "output_tokens_capped": sum(min(n, args.max_output_len) for n in workload.output_lens),
        },
        "results": summary,
        "requests": [asdict(r) for r in results],
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
