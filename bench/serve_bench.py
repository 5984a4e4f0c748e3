"""Serving benchmark: a seeded workload against a running OpenAI-compatible endpoint, like vLLM's
``benchmark_serving.py``, and the same arrival trace served by a plain HF transformers loop, in one run.

The workload is the offline benchmark's (``workload.make_workload``: real-text prompts of uniform length
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
            summarized by the same code as cb-serve's. The model is loaded like ``hf_baseline.load_hf_model``
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

cb-serve's engine scheduling + batch-building share of the step time comes from the server's ``/stats``
counters (``scheduling_seconds`` / ``step_seconds`` over the timed run); the ``cb_serve_*`` metrics
(``cb_serve/serve/metrics.py``, scraped from Ray's metrics export port, not served by the router) have batch
fill and sequences per step but no step-phase timings, and ``bench/profile_step.py`` measures the full
per-phase breakdown offline. What ``/stats`` gives (steps, tokens, preemptions during the run) is recorded.

The pieces live in modules beside this script: ``workload`` (the workload and arrival trace),
``serving_client`` (the HTTP client), ``server_control`` (``--launch``), ``hf_serving`` (the HF system),
``serving_stats`` (summaries and tables) and ``cpu_accounting`` (foreign CPU share).

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
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_accounting import Contention, contended  # noqa: E402
from hf_baseline import HF_STATIC_BATCH_SIZE  # noqa: E402
from hf_serving import run_hf  # noqa: E402
from inspect_capture import fetch_trace, screenshot_later  # noqa: E402
from report import cb_serve_source, log, run_info, write_json  # noqa: E402
from server_control import (  # noqa: E402
    DEFAULT_CONFIG,
    launch,
    replica_threads,
    server_answers,
    server_root,
    stop,
    wait_until_ready,
)
from serving_client import SCHEDULING_SHARE_NOTE, run_benchmark  # noqa: E402
from serving_stats import comparison, comparison_table, summarize, table  # noqa: E402
from workload import Workload, arrival_times, capped_output_lens, make_workload  # noqa: E402

from cb_serve.model_executor import loader  # noqa: E402

SYSTEMS = ("cb-serve", "hf")


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
    parser.add_argument("--trace-out", metavar="PATH", help="Save cb-serve's /debug/trace of the run's end here.")
    parser.add_argument("--trace-seconds", type=float, default=10.0, help="Seconds of trace to save (default 10).")
    parser.add_argument("--screenshot", metavar="PNG", help="Screenshot /inspect (headless Chromium) mid-run.")
    parser.add_argument("--screenshot-after", type=float, default=20.0, help="Seconds into the run (default 20).")
    args = parser.parse_args(argv)
    check_systems(parser, args)
    return args


def check_systems(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Normalizes ``--base-url`` and ``--systems`` (cb-serve first); resolves ``--hf-threads``."""
    args.base_url = args.base_url.rstrip("/")
    args.systems = ["cb-serve"] if args.skip_hf else [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)} (got {', '.join(unknown) or 'none'})")
    args.systems = [s for s in SYSTEMS if s in args.systems]  # cb-serve first, then HF: never overlapping
    if "hf" not in args.systems:
        return
    if args.hf_threads is None:
        args.hf_threads, args.hf_threads_source = replica_threads(Path(args.launch or DEFAULT_CONFIG))
    else:
        args.hf_threads_source = "--hf-threads"
    if "cb-serve" in args.systems and not args.launch:
        parser.error(
            "HF and cb-serve must not run at the same time: with both systems use --launch CONFIG "
            "(the server is stopped before HF runs), or run --systems cb-serve and --systems hf "
            "separately with the server stopped in between"
        )


def run_cb_serve(args: argparse.Namespace, workload: Workload, arrivals: Sequence[float]) -> dict[str, Any]:
    if args.launch and server_answers(args.base_url):
        raise SystemExit(
            f"something already answers at {server_root(args.base_url)}/health; stop it or pass "
            "another --base-url (matching the config's port) before --launch"
        )
    log_path = Path(args.json or "serve_bench").with_suffix(".server.log")
    proc = launch(args.launch, log_path) if args.launch else None
    leftover: list[int] = []
    try:
        served = wait_until_ready(args.base_url, args.api_key, args.launch_timeout, proc)
        model = args.model or served
        log(f"[cb-serve] ready, model {model}; rate {args.request_rate}/s, concurrency {args.max_concurrency or 'any'}")
        root = server_root(args.base_url)
        shot = screenshot_later(root, Path(args.screenshot), args.screenshot_after) if args.screenshot else None
        with Contention(None if proc is None else [os.getpid(), proc.pid]) as contention:
            duration_s, results, engine = asyncio.run(run_benchmark(args, model, workload, arrivals))
        if shot is not None:
            shot.join()
        if args.trace_out:
            size = fetch_trace(root, args.api_key, args.trace_seconds, Path(args.trace_out))
            log(f"[cb-serve] trace of the last {args.trace_seconds:g} s: {args.trace_out} ({size:,} bytes)")
    finally:
        if proc is not None:
            leftover = stop(proc)
            if leftover:
                log(f"WARNING: processes of `serve run` still alive after stopping it: {leftover}")
            else:
                log("[cb-serve] server stopped, all of its processes gone")
    summary = {**summarize(duration_s, results), "foreign_cpu_share": contention.foreign_cpu_share}
    return {"summary": summary, "requests": results, "engine": engine, "server_leftover_pids": leftover}


def log_cb_serve(run: dict[str, Any]) -> None:
    log("[cb-serve] results:\n" + table(run["summary"]))
    engine = run["engine"]
    counters = {k: v for k, v in engine.items() if "note" not in k}
    log(f"[cb-serve] engine during the run (/stats): {json.dumps(counters)}")
    share = engine.get("scheduling_share")
    log(
        f"[cb-serve] scheduling + batch-building share of step time: "
        f"{'n/a' if share is None else f'{share:.2%}'} ({SCHEDULING_SHARE_NOTE})"
    )


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


def log_comparison(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prints the comparison table and each system's foreign CPU share; returns the comparison."""
    summaries = {name: run["summary"] for name, run in runs.items()}
    comp = comparison(summaries)
    log("\ncomparison (same trace; cb-serve advantage = cb-serve / HF for throughputs, HF / cb-serve for latencies):")
    log(comparison_table(comp, list(runs)))
    for name, s in summaries.items():
        share = s["foreign_cpu_share"]
        if share is not None:
            log(f"foreign CPU share during {name}: {share:.1%} (0 = the machine was ours)")
            if contended(share):
                log(f"WARNING: other processes kept {share:.0%} of the CPUs busy during {name}; rerun when idle")
    return comp


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    loadavg_before = os.getloadavg()  # the machine should be otherwise idle; this is a hint whether it was
    log(f"serving benchmark, {started}: {' '.join(sys.argv)}")
    log(f"systems: {', '.join(args.systems)}")
    tokenizer = loader.load_tokenizer(loader.resolve_model_source(args.tokenizer))
    workload = make_workload(tokenizer, args.num_requests, args.seed)
    arrivals = arrival_times(workload.num_requests, args.request_rate, args.seed)
    log(
        f"workload: {json.dumps(workload.summary())} (outputs capped at {args.max_output_len}); "
        f"arrivals over {arrivals[-1]:.1f} s"
    )

    runs: dict[str, dict[str, Any]] = {}
    if "cb-serve" in args.systems:
        runs["cb-serve"] = run_cb_serve(args, workload, arrivals)
        log_cb_serve(runs["cb-serve"])
    if "hf" in args.systems:
        runs["hf"] = run_hf_system(args, workload, arrivals)
        log("[hf] results:\n" + table(runs["hf"]["summary"]))
    comp = log_comparison(runs)
    out = {
        **run_info(started),
        "cb_serve": cb_serve_source(),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "config": {k: str(v) if v == math.inf else v for k, v in vars(args).items() if k != "api_key"},
        "workload": {
            **workload.summary(),
            "output_tokens_capped": sum(capped_output_lens(workload, args.max_output_len)),
            "arrival_s": arrivals,
        },
        "results": {name: run["summary"] for name, run in runs.items()},
        "comparison": comp,
        **({"cb_serve_engine": runs["cb-serve"]["engine"]} if "cb-serve" in runs else {}),
        **({"hf": runs["hf"]["hf"]} if "hf" in runs else {}),
        "requests": {name: [asdict(r) for r in run["requests"]] for name, run in runs.items()},
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
