"""Serving benchmark (``cb-serve bench serve``): a seeded workload against a running OpenAI-compatible
endpoint, like ``vllm bench serve``, and optionally the same arrival trace served by a plain HF
transformers loop, in one run.

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

``cb-serve bench serve`` runs cb-serve alone by default; ``bench/serve_bench.py`` (the same benchmark)
runs both systems by default. From the repository root:
    cb-serve bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 --save-result  # a running server
    cb-serve bench serve --launch deploy/config.yaml --num-prompts 32 --compare-hf        # cb-serve, then HF
    .venv/bin/python bench/serve_bench.py --launch deploy/config.yaml --num-requests 32   # the same
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

from cb_serve.benchmarks.cpu_accounting import Contention, contended
from cb_serve.benchmarks.hf_serving import run_hf
from cb_serve.benchmarks.inspect_capture import fetch_trace, screenshot_later
from cb_serve.benchmarks.report import cb_serve_source, log, run_info, write_json
from cb_serve.benchmarks.serve_args import add_cli_args
from cb_serve.benchmarks.server_control import (
    DEFAULT_CONFIG,
    launch,
    replica_threads,
    server_answers,
    server_root,
    stop,
    wait_until_ready,
)
from cb_serve.benchmarks.serving_client import SCHEDULING_SHARE_NOTE, run_benchmark
from cb_serve.benchmarks.serving_stats import comparison, comparison_table, summarize, table
from cb_serve.benchmarks.workload import Workload, arrival_times, capped_output_lens, make_workload
from cb_serve.model_executor import loader

SYSTEMS = ("cb-serve", "hf")


def parse_args(argv: Sequence[str] | None = None, default_systems: str = "cb-serve") -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser, default_systems)
    args = parser.parse_args(argv)
    check_systems(parser, args)
    return args


def result_path(args: argparse.Namespace, model: str | None) -> str | None:
    """Where the results go: ``--json``, else with ``--save-result`` vLLM's file-name pattern."""
    if args.json or not args.save_result:
        return args.json
    if args.result_filename:
        name = args.result_filename
    else:
        rate = "inf" if args.request_rate == math.inf else f"{args.request_rate:g}"
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model_id = (model or "model").rstrip("/").split("/")[-1]
        name = f"cb-serve-{rate}qps{concurrency}-{model_id}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = Path(args.result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def check_systems(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Normalizes ``--base-url`` (to .../v1) and ``--systems`` (cb-serve first); resolves ``--hf-threads``."""
    args.base_url = server_root(args.base_url) + "/v1"
    args.systems = ["cb-serve"] if args.skip_hf else [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.compare_hf and not args.skip_hf:
        args.systems.append("hf")
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
    log_path = Path(args.json or Path(args.result_dir) / "serve_bench").with_suffix(".server.log")
    proc = launch(args.launch, log_path) if args.launch else None
    leftover: list[int] = []
    try:
        served = wait_until_ready(args.base_url, args.api_key, args.launch_timeout, proc)
        model = args.model = args.model or served
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


def main(argv: Sequence[str] | None = None, default_systems: str = "cb-serve") -> dict[str, Any]:
    args = parse_args(argv, default_systems)
    return run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark that ``args`` (``add_cli_args``' flags) describes; returns its results."""
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
    write_json(result_path(args, args.model), out)
    return out


if __name__ == "__main__":
    main()
