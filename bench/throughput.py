"""Offline throughput benchmark: cb-serve vs HF transformers (static and continuous batching) vs llama.cpp vs
the CPU GEMM roofline, and how close cb-serve's decode steps come to the DRAM bandwidth bound.

The workload is fixed by ``--seed``: ``--num-requests`` prompts of real text (docstrings of a fixed list of
Python standard-library modules, tokenized with the model's tokenizer; windows of uniform length in
[32, 512] tokens cut at seeded random offsets) with output lengths uniform in [16, 256], greedy, EOS ignored.
All requests are submitted at once; throughput = generated tokens / wall seconds of generation only (model
loading, KV-cache allocation and a one-request warmup are not timed).

Systems:
  1. cb-serve      ``LLM(**engine args).generate(...)``; engine args are settable from the command line.
  2. hf-static     ``model.generate`` on batches of 16 requests in arrival order, left padding,
                   ``max_new_tokens`` = the longest output of the batch; only each request's own output
                   tokens count as generated (the rest of the batch's decode steps are wasted work).
  3. hf-continuous transformers' continuous batching (``generate_batch``'s manager, one ``add_request`` per
                   request with its own ``max_new_tokens``; ``--hf-cb-api generate_batch`` calls
                   ``model.generate_batch`` with the largest output length for every request instead).
  4. llama.cpp     (only when named in ``--systems``) ``llama-server`` built from the llama.cpp that the
                   llama-cpp-python sdist vendors (cached, see ``cb_serve/benchmarks/llama_cpp.py``) on the
                   same GGUF file (or ``--llama-gguf``'s, e.g. a conversion of cb-serve's HF directory:
                   ``bench/moe_bench.py``), 16 slots with continuous batching, the same threads; the
                   token-id prompts over loopback HTTP, all at once. Skipped with a one-line reason if it
                   cannot be built or run here.
  5. roofline      fp32 GEMM FLOP/s at M=256 over the model's matmul shapes, divided by the model's matmul
                   FLOP per token (of a mixture of experts: its router and top-k experts per token).

Beside throughput: each system's greedy agreement with hf-static; batch invariance of cb-serve and
llama.cpp (the first ``--invariance-requests`` requests again one at a time, compared with their batched
outputs); the DRAM read bandwidth and, over cb-serve's decode-only steps, (bytes read / step time) /
read bandwidth (``cb_serve/benchmarks/bandwidth.py``; of a mixture of experts, the weights of the experts
each step's tokens hit); with ``--profile-decode``, torch.profiler's op
breakdown of a few decode steps (``op_profile``).

The pieces live in modules beside this script: ``workload`` (the seeded workload), ``cb_offline`` (cb-serve),
``hf_baseline`` (HF), ``llama_cpp``, ``bandwidth``, ``roofline``, ``cpu_accounting`` (foreign CPU share) and
``report``.

Run from the repository root:
    .venv/bin/python bench/throughput.py                      # everything (~15-20 min on 2 CPU cores)
    .venv/bin/python bench/throughput.py --num-requests 8     # smoke test
    .venv/bin/python bench/throughput.py --systems cb-serve,hf-static,llama.cpp --json /tmp/all.json
    .venv/bin/python bench/throughput.py --skip-hf --max-num-batched-tokens 1024 --json /tmp/cb.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from cb_offline import check_batch_invariance, decode_bandwidth_bound, engine_kwargs, run_cb_serve_steps
from op_profile import op_profile
from roofline import measure_roofline, print_roofline, workload_roofline

from cb_serve import LLM
from cb_serve.benchmarks.bandwidth import print_decode_bound
from cb_serve.benchmarks.hf_baseline import HF_STATIC_BATCH_SIZE, load_hf_model, run_hf_continuous, run_hf_static
from cb_serve.benchmarks.llama_cpp import LlamaCppUnavailable, run_llama_cpp
from cb_serve.benchmarks.report import (
    SystemResult,
    cb_serve_ratios,
    cb_serve_source,
    log,
    print_system,
    print_systems_table,
    run_info,
    write_json,
)
from cb_serve.benchmarks.workload import Workload, make_workload
from cb_serve.config import EngineConfig
from cb_serve.model_executor import loader

SYSTEMS = ("cb-serve", "hf-static", "hf-continuous", "llama.cpp")
DEFAULT_SYSTEMS = ("cb-serve", "hf-static", "hf-continuous")


def parse_args(argv: Sequence[str] | None = None, description: str | None = __doc__) -> argparse.Namespace:
    """The engine's arguments plus the benchmark's (``bench/profile_step.py`` takes the same)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve"
    )
    EngineConfig.add_cli_args(parser)  # cb-serve's engine arguments; --seed below also seeds the engine
    parser.add_argument("--num-requests", type=int, default=64, help="Number of requests (default: 64).")
    parser.add_argument("--seed", type=int, default=0, help="Workload (and engine) seed (default: 0).")
    parser.add_argument("--skip-hf", action="store_true", help="Only cb-serve and the roofline.")
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"Comma-separated systems to run, of {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)}); "
        "the roofline always runs.",
    )
    parser.add_argument(
        "--hf-cb-api",
        choices=["manager", "generate_batch"],
        default="manager",
        help="HF continuous batching through the manager with per-request max_new_tokens (default), or "
        "generate_batch with the largest output length for every request.",
    )
    parser.add_argument(
        "--invariance-requests",
        type=int,
        default=8,
        help="Requests run again one at a time to check batch invariance (cb-serve, llama.cpp; 0: off; default: 8).",
    )
    parser.add_argument(
        "--profile-decode",
        action="store_true",
        help="Also torch.profiler's op breakdown of a few cb-serve decode steps (a second, untimed workload).",
    )
    parser.add_argument(
        "--llama-gguf",
        metavar="PATH",
        help="The GGUF file llama.cpp serves (default: cb-serve's model, which must then be a GGUF file); the "
        "same weights as cb-serve's, e.g. converted from its HF directory (bench/moe_bench.py).",
    )
    parser.add_argument("--json", metavar="OUT", help="Write the results as JSON to OUT.")
    return parser.parse_args(argv)


def chosen_systems(args: argparse.Namespace) -> list[str]:
    systems = ["cb-serve"] if args.skip_hf else args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"Unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}.")
    return systems


def run_hf_systems(
    model_source: loader.ModelSource, tokenizer, dtype: torch.dtype, workload: Workload, systems: list[str], api: str
) -> tuple[dict[str, SystemResult], dict[str, str]]:
    """The HF ones of ``systems`` on cb-serve's model (released before); their results and errors."""
    results: dict[str, SystemResult] = {}
    errors: dict[str, str] = {}
    if "hf-static" not in systems and "hf-continuous" not in systems:
        return results, errors
    gc.collect()  # the engine's last reference is gone: free its weights and KV cache first
    model = load_hf_model(model_source, dtype)
    if "hf-static" in systems:
        results["hf-static"] = run_hf_static(model, tokenizer, workload, HF_STATIC_BATCH_SIZE)
        print_system(results["hf-static"])
    if "hf-continuous" in systems:
        try:
            results["hf-continuous"] = run_hf_continuous(model, workload, api)
            print_system(results["hf-continuous"])
        except Exception as e:  # reported, not fatal: the other numbers still stand
            log(f"[hf-continuous] failed: {type(e).__name__}: {e}")
            errors["hf-continuous"] = f"{type(e).__name__}: {e}"
    return results, errors


def run_cb_serve_checks(
    llm: LLM, workload: Workload, args: argparse.Namespace, read_gb_s: float
) -> tuple[SystemResult, dict[str, Any] | None, dict[str, Any] | None]:
    """cb-serve's timed run, then (untimed) its batch invariance, its decode steps' DRAM bandwidth bound and,
    with ``--profile-decode``, the op profile of a few decode steps of a second workload (seed + 1)."""
    result, steps = run_cb_serve_steps(llm, workload)
    if args.invariance_requests:
        check_batch_invariance(llm, workload, result, args.invariance_requests)
    print_system(result)
    bound = decode_bandwidth_bound(llm, steps, read_gb_s)
    print_decode_bound(bound, result.extra["decode_only_steps"])
    profile = None
    if args.profile_decode:
        start = time.perf_counter()
        ops, op_kinds = op_profile(llm, make_workload(llm.engine.tokenizer, args.num_requests, args.seed + 1))
        profile = {"ops": ops, "op_kinds": op_kinds, "seconds": time.perf_counter() - start}
        log(f"decode op profile took {profile['seconds']:.1f} s")
    return result, bound, profile


def run_llama(
    source: loader.ModelSource, tokenizer, workload: Workload, invariance_requests: int, gguf: str | None = None
) -> tuple[SystemResult | None, str | None]:
    """llama.cpp on ``gguf``, by default cb-serve's GGUF file; (None, why) when it cannot run here: never fatal."""
    try:
        if gguf is None and source.gguf_file is None:
            raise LlamaCppUnavailable(f"cb-serve's model {source.name} is not a GGUF file (pass --llama-gguf)")
        gguf = gguf or str(Path(source.path) / str(source.gguf_file))
        log_path = Path(tempfile.gettempdir()) / f"llama-server-{time.strftime('%Y%m%d-%H%M%S')}.log"
        result = run_llama_cpp(gguf, workload, tokenizer, torch.get_num_threads(), invariance_requests, log_path)
    except Exception as e:  # reported in one line, not fatal: the other systems' numbers still stand
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        log(f"[llama.cpp] skipped: {reason}")
        return None, reason
    print_system(result)
    return result, None


def report(workload: Workload, roofline: dict[str, Any], results: dict[str, SystemResult]) -> dict[str, Any]:
    """Prints the roofline, the systems table and cb-serve's ratios; the JSON's ``roofline`` and ``ratios``."""
    roofline["workload_roofline_generated_tok_s"] = bound = workload_roofline(roofline, workload)
    log("")
    print_roofline(roofline, workload)
    log("")
    ratios = cb_serve_ratios(results, bound)
    log("")
    print_systems_table(results, bound, [roofline["foreign_cpu_share"]])
    return {"roofline": roofline, "ratios": ratios}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    log(f"throughput benchmark, {started}: {' '.join(sys.argv)}")
    log(f"python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    source = cb_serve_source()
    log(f"cb_serve: {json.dumps(source)}")

    load_start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    log(f"cb-serve loaded in {time.perf_counter() - load_start:.1f} s")
    workload = make_workload(llm.engine.tokenizer, args.num_requests, args.seed)
    log(f"workload: {json.dumps(workload.summary())}")

    systems = chosen_systems(args)
    roofline = measure_roofline(llm.engine.hf_config, llm.engine.dtype)
    results: dict[str, SystemResult] = {}
    bound = profile = None
    if "cb-serve" in systems:
        results["cb-serve"], bound, profile = run_cb_serve_checks(llm, workload, args, roofline["memory_read_gb_s"])
    hf_inputs = (llm.engine.source, llm.engine.tokenizer, llm.engine.dtype)
    del llm  # the other systems run alone
    hf_results, errors = run_hf_systems(*hf_inputs, workload, systems, args.hf_cb_api)
    results.update(hf_results)
    if "llama.cpp" in systems:
        llama, reason = run_llama(*hf_inputs[:2], workload, args.invariance_requests, args.llama_gguf)
        if llama is not None:
            results["llama.cpp"] = llama
        else:
            errors["llama.cpp"] = str(reason)

    summary = report(workload, roofline, results)
    out = {
        **run_info(started),
        "threads": torch.get_num_threads(),
        "cb_serve": source,
        "engine_args": engine_kwargs(args),
        "workload": workload.summary(),
        "systems": {name: r.to_json() for name, r in results.items()},
        **summary,
        "decode_bandwidth_bound": bound,
        "decode_op_profile": profile,
        "errors": errors,
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
