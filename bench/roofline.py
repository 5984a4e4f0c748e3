"""The roofline: how fast the machine's GEMMs (and memory copies) could run the model at best, and the
DRAM read bandwidth that bounds decode steps (``cb_serve.benchmarks.bandwidth``).

``measure_roofline`` times fp32 GEMMs at M=``GEMM_M`` rows over the model's matmul shapes; the model's
matmul FLOP per token divided by the model-mix GEMM rate gives processed tokens/s, and ``workload_roofline``
turns that into generated tokens/s for a workload (its prompt tokens cost the same FLOP as its outputs). The
shapes and their counts per token come from ``cb_serve.benchmarks.model_shapes``: of a mixture of experts,
the router and the ``top_k`` experts each token is routed to (all at the M=``GEMM_M`` rate, a best case:
an expert's share of a decode step is a few rows).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from cb_serve.benchmarks.bandwidth import read_bandwidth
from cb_serve.benchmarks.cpu_accounting import Timer
from cb_serve.benchmarks.model_shapes import extra_gemm_shape, model_gemm_shapes, moe_layout
from cb_serve.benchmarks.report import log
from cb_serve.benchmarks.workload import Workload

GEMM_M = 256


def time_matmul(m: int, k: int, n: int, dtype: torch.dtype, min_reps: int = 7, min_seconds: float = 0.5) -> float:
    """Median seconds of one ``[m, k] @ [k, n]`` over at least ``min_reps`` repetitions."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    times: list[float] = []
    budget_end = time.perf_counter() + min_seconds
    while len(times) < min_reps or time.perf_counter() < budget_end:
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(
    num_bytes: int = 256 << 20,
    reps: int = 7,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    warmup: int = 1,
) -> float:
    """GB/s (read + write) of a large tensor copy, median over ``reps`` after ``warmup`` untimed copies:
    what bounds decode steps, which stream all weights and KV."""
    device = device or torch.device("cpu")
    src = torch.ones(num_bytes // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * num_bytes / statistics.median(times) / 1e9


def measure_roofline(hf_config, dtype: torch.dtype) -> dict[str, Any]:
    shapes = model_gemm_shapes(hf_config)
    extra = extra_gemm_shape(hf_config)
    per_shape: dict[str, dict[str, float]] = {}
    with Timer() as timer:
        for shape in [*shapes, extra]:
            seconds = time_matmul(GEMM_M, shape.k, shape.n, dtype)
            flop = 2 * GEMM_M * shape.k * shape.n
            per_shape[shape.name] = {
                "m": GEMM_M,
                "k": shape.k,
                "n": shape.n,
                "median_s": seconds,
                "gflop_s": flop / seconds / 1e9,
            }
        copy_gb_s = copy_bandwidth()
        read = read_bandwidth()
    flop_per_token = sum(s.flop_per_token for s in shapes)
    # The model's mix: time per token = sum over shapes of its FLOP / its rate.
    seconds_per_token = sum(s.flop_per_token / (per_shape[s.name]["gflop_s"] * 1e9) for s in shapes)
    rate = flop_per_token / seconds_per_token
    moe = moe_layout(hf_config)
    return {
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "flop_per_token": flop_per_token,
        "matmul_params": flop_per_token // 2,  # of a mixture of experts: the active ones (top-k experts)
        "moe": None if moe is None else asdict(moe),
        "per_shape": per_shape,
        "model_mix_gflop_s": rate / 1e9,
        "roofline_tok_s": rate / flop_per_token,
        "memory_copy_gb_s": copy_gb_s,
        "memory_read_gb_s": read["gb_s"],
        "memory_read_method": read["method"],
        "memory_read": read,
        "foreign_cpu_share": timer.foreign_cpu_share,
    }


def workload_roofline(roofline: dict[str, Any], workload: Workload) -> float:
    """Generated tokens/s at the roofline for ``workload`` (every processed token at the model-mix rate)."""
    processed = workload.prompt_tokens + workload.output_tokens
    return workload.output_tokens / (processed * roofline["flop_per_token"] / (roofline["model_mix_gflop_s"] * 1e9))


def print_roofline(roofline: dict[str, Any], workload: Workload) -> None:
    log(f"== roofline ({roofline['dtype']} GEMM, M={GEMM_M}, {roofline['threads']} threads) ==")
    for name, s in roofline["per_shape"].items():
        log(f"    {name:13s} [{s['m']}, {s['k']}] x [{s['k']}, {s['n']}]: {s['gflop_s']:.1f} GFLOP/s")
    moe = roofline.get("moe")
    active = "" if moe is None else f"; router + top {moe['top_k']} of {moe['num_experts']} experts"
    log(f"    FLOP/token (matmuls incl. LM head{active}): {roofline['flop_per_token'] / 1e9:.4f} GFLOP")
    log(f"    model-mix GEMM rate: {roofline['model_mix_gflop_s']:.1f} GFLOP/s")
    log(f"    memory bandwidth (256 MB tensor copy, read + write): {roofline['memory_copy_gb_s']:.1f} GB/s")
    read = roofline["memory_read"]
    methods = ", ".join(f"{name} {gb_s:.1f}" for name, gb_s in read["per_method_gb_s"].items())
    log(
        f"    DRAM read bandwidth ({read['bytes'] >> 20} MiB float32, best of {read['reps']}): {read['gb_s']:.1f} GB/s "
        f"by {read['method']} ({methods})"
    )
    log(f"    roofline: {roofline['roofline_tok_s']:.1f} processed tok/s")
    processed = workload.prompt_tokens + workload.output_tokens
    log(
        f"    workload roofline: {roofline['workload_roofline_generated_tok_s']:.1f} generated tok/s "
        f"({processed} processed tokens)"
    )
