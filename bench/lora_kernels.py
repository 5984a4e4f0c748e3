"""The CPU kernel choice for multi-LoRA: ``cpu_ops.lora_apply`` (every adapter of a step in one C++
call, per token) against the torch-ops path (per adapter: gather its tokens, two GEMMs, add back),
on one decoder layer's four projections of SmolLM2-135M (hidden 576, q/k/v 960 out, MLP 1536),
float32, at decode-sized and prefill-sized token counts, with the tokens spread over 1 or 8
adapters (rank 16 on every projection). The base projections' own time is the reference.

    .venv/bin/python bench/lora_kernels.py --out bench/results/lora_kernels.json    # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from cb_serve import cpu_ops
from cb_serve.benchmarks.report import log, run_info, write_json
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.lora.layers import LoRABatch, LoRALinear
from cb_serve.model_executor.layers.linear import Linear

# (in, out, sub-projections) of SmolLM2-135M's fused projections
PROJECTIONS = {"qkv": (576, 960, 3), "o": (576, 576, 1), "gate_up": (576, 3072, 2), "down": (1536, 576, 1)}
RANK = 16
MAX_LORAS = 8


def layer_projections(batch: LoRABatch) -> dict[str, LoRALinear]:
    torch.manual_seed(0)
    out = {}
    for name, (k, n, subs) in PROJECTIONS.items():
        base = Linear(k, n, bias=False)
        base.prepare_for_cpu(pack=cpu_ops.available())
        layer = LoRALinear(base, batch, MAX_LORAS, subs * RANK)
        for slot in range(MAX_LORAS):
            layer.set_slot(slot, (torch.randn(subs * RANK, k) * 0.05, torch.randn(subs * RANK, n) * 0.05))
        out[name] = layer
    return out


def time_layer(projections: dict[str, LoRALinear], inputs: dict[str, torch.Tensor], mode: str, repeats: int) -> float:
    """Median seconds of one pass over the four projections (``mode``: base, kernel, gemm)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for name, layer in projections.items():
            x = inputs[name]
            if mode == "base":
                layer.base(x)
            else:
                layer.use_cpu_kernel = mode == "kernel"
                layer(x)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,32,64,256,1024")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    model, flags = cpu_model_and_flags()
    assert cpu_ops.available(), "the C++ kernels must build for this benchmark"
    batch = LoRABatch()
    projections = layer_projections(batch)
    rows = []
    log(f"CPU: {model} (AMX: {'amx_tile' in flags}), {torch.get_num_threads()} threads")
    log(f"{'tokens':>6} {'adapters':>8} {'base us':>9} {'kernel us':>10} {'gemm us':>9} {'kernel/base':>11}")
    for tokens in map(int, args.tokens.split(",")):
        for adapters in (1, 8):
            # Decode-like: token i belongs to request i, requests round-robin over adapters;
            # prefill-like (more tokens than requests): runs of 128 tokens per request.
            run = 1 if tokens <= 64 else 128
            slots = np.asarray([(i // run) % adapters for i in range(tokens)])
            batch.set_groups(slots, torch.device("cpu"))
            inputs = {name: torch.randn(tokens, k) for name, (k, _, _) in PROJECTIONS.items()}
            for mode in ("base", "kernel", "gemm"):  # warm-up
                time_layer(projections, inputs, mode, 3)
            t = {mode: time_layer(projections, inputs, mode, args.repeats) for mode in ("base", "kernel", "gemm")}
            row = {"tokens": tokens, "adapters": adapters, **{f"{m}_us": v * 1e6 for m, v in t.items()}}
            row["kernel_lora_us"] = row["kernel_us"] - row["base_us"]
            row["gemm_lora_us"] = row["gemm_us"] - row["base_us"]
            rows.append(row)
            log(
                f"{tokens:>6} {adapters:>8} {row['base_us']:>9.1f} {row['kernel_us']:>10.1f} {row['gemm_us']:>9.1f} "
                f"{row['kernel_us'] / row['base_us']:>11.2f}"
            )
    write_json(args.out, {**run_info(started), "cpu": model, "amx": "amx_tile" in flags, "rank": RANK, "rows": rows})


if __name__ == "__main__":
    main()
