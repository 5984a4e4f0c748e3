"""HF transformers serving a trace the way a plain HF server would (``serve_bench.py``'s ``hf`` system):
one worker that, whenever it is free, takes the requests that have arrived (at most ``batch_size``, in
arrival order) and runs them as one static left-padded ``generate`` batch; a streamer timestamps each
generation step, which gives each request its token times (up to its own output length)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from cb_serve.benchmarks.hf_baseline import eos_disabled, hf_static_batch, load_hf_model, pad_token_id
from cb_serve.benchmarks.report import log
from cb_serve.benchmarks.serving_stats import RequestResult
from cb_serve.benchmarks.workload import Workload, capped_output_lens, warmup_prompt
from cb_serve.model_executor import loader


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
    """``hf_static_batch`` with a step clock; checks that the clock saw every step and token."""
    new = hf_static_batch(model, prompts, max_new_tokens, pad_id, streamer).tolist()
    if len(streamer.times) != max_new_tokens or any(len(row) != max_new_tokens for row in new):
        raise RuntimeError(f"hf: {len(streamer.times)} steps streamed, {max_new_tokens} tokens expected")
    if [list(step) for step in zip(*new)] != streamer.tokens:
        raise RuntimeError("hf: the streamed tokens differ from generate()'s output")
    return new


def next_batch(taken: int, arrivals: Sequence[float], now: float, batch_size: int) -> list[int]:
    """Request ``taken`` and those after it that have arrived by ``now``, at most ``batch_size``."""
    batch = [taken]
    while taken + len(batch) < len(arrivals) and len(batch) < batch_size and arrivals[taken + len(batch)] <= now:
        batch.append(taken + len(batch))
    return batch


def record_batch(results: list[RequestResult], batch: list[int], lens: list[int], times: list[float]) -> None:
    """Each request's token times (seconds after the start; the batch's steps up to its own length)."""
    for i, own_len in zip(batch, lens):
        r, own = results[i], times[:own_len]
        r.ttft_s, r.latency_s = own[0] - r.arrival_s, own[-1] - r.arrival_s
        r.itl_s = [b - a for a, b in zip(own, own[1:])]
        r.completion_tokens, r.ok = len(own), len(own) == r.output_len


def batch_info(prompts: list[list[int]], lens: list[int], start_s: float, wall_s: float) -> dict[str, Any]:
    return {
        "size": len(prompts),
        "start_s": start_s,
        "wall_s": wall_s,
        "max_new_tokens": max(lens),
        "padded_prompt_len": max(len(p) for p in prompts),
        "padding_tokens": sum(max(len(p) for p in prompts) - len(p) for p in prompts),
        "wasted_decode_tokens": sum(max(lens) - k for k in lens),
    }


def serve_trace(
    model, pad_id: int, workload: Workload, output_lens: list[int], arrivals: Sequence[float], batch_size: int
) -> tuple[float, list[RequestResult], list[dict[str, Any]]]:
    """The trace through one worker: wall seconds, each request's record and each batch's info."""
    results = [RequestResult(len(p), n, arrival_s=a) for p, n, a in zip(workload.prompts, output_lens, arrivals)]
    batches: list[dict[str, Any]] = []
    taken = 0
    start = time.perf_counter()
    while taken < workload.num_requests:
        wait = start + arrivals[taken] - time.perf_counter()
        if wait > 0:  # idle until the next request arrives
            time.sleep(wait)
        batch = next_batch(taken, arrivals, time.perf_counter() - start, batch_size)
        taken += len(batch)
        prompts, lens = [workload.prompts[i] for i in batch], [output_lens[i] for i in batch]
        clock = StepClock()
        batch_start = time.perf_counter() - start
        hf_generate(model, prompts, max(lens), pad_id, clock)
        for i in batch:
            results[i].queue_s, results[i].batch_size = batch_start - results[i].arrival_s, len(batch)
        record_batch(results, batch, lens, [t - start for t in clock.times])
        batches.append(batch_info(prompts, lens, batch_start, clock.times[-1] - start - batch_start))
    return time.perf_counter() - start, results, batches


@torch.inference_mode()
def run_hf(
    args: argparse.Namespace, workload: Workload, arrivals: Sequence[float]
) -> tuple[float, list[RequestResult], dict[str, Any]]:
    """The trace through one HF worker taking the arrived requests as static batches (module docstring)."""
    torch.set_num_threads(args.hf_threads)
    source = loader.resolve_model_source(args.hf_model)
    load_start = time.perf_counter()
    model = load_hf_model(source, torch.float32)
    pad_id = pad_token_id(loader.load_tokenizer(source))
    log(
        f"[hf] {source.name} loaded in {time.perf_counter() - load_start:.1f} s (float32, {torch.get_num_threads()} "
        f"torch threads), batches of at most {args.hf_batch_size}"
    )
    output_lens = capped_output_lens(workload, args.max_output_len)
    with eos_disabled(model):
        for _ in range(args.warmup):  # untimed, like cb-serve's warmup request
            hf_generate(model, [warmup_prompt(workload)], 8, pad_id, StepClock())
        duration_s, results, batches = serve_trace(model, pad_id, workload, output_lens, arrivals, args.hf_batch_size)
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
