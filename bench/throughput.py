"""Offline throughput benchmark: cb-serve vs HF transformers (static and continuous batching) vs the CPU GEMM roofline.

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
  4. roofline      fp32 GEMM FLOP/s at M=256 over the model's matmul shapes, divided by the model's matmul
                   FLOP per token.

Run from the repository root:
    .venv/bin/python bench/throughput.py                      # everything (~15-20 min on 2 CPU cores)
    .venv/bin/python bench/throughput.py --num-requests 8     # smoke test
    .venv/bin/python bench/throughput.py --skip-hf --max-num-batched-tokens 1024 --json /tmp/cb.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import importlib
import inspect
import json
import logging
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import cb_serve
from cb_serve import LLM, SamplingParams
from cb_serve.config import EngineConfig
from cb_serve.engine.stats import StepStats
from cb_serve.model_executor import loader

# Standard-library modules whose docstrings (module, then public classes and functions by name) form the corpus.
CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "email.message", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "itertools",
    "json", "logging", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "statistics", "string",
    "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "zipfile",
)  # fmt: skip
PROMPT_LEN_RANGE = (32, 512)
OUTPUT_LEN_RANGE = (16, 256)
HF_STATIC_BATCH_SIZE = 16
SYSTEMS = ("cb-serve", "hf-static", "hf-continuous")
GEMM_M = 256
CONTENTION_WARNING = 0.05  # foreign CPU share above which a measurement is flagged


# ---- workload ----------------------------------------------------------------------------------------------------
def corpus_text() -> str:
    """Deterministic real English/technical text: stdlib docstrings in a fixed order."""
    parts: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        if doc := inspect.getdoc(module):
            parts.append(doc)
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            is_api = inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)
            if attr.startswith("_") or not is_api or getattr(obj, "__module__", None) != module.__name__:
                continue
            if doc := inspect.getdoc(obj):
                parts.append(doc)
    return "\n\n".join(parts)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    corpus_tokens: int
    digest: str  # sha256 of the prompts and output lengths, to compare runs

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_len_mean": statistics.fmean(lens),
            "prompt_len_min": min(lens),
            "prompt_len_max": max(lens),
            "output_len_mean": statistics.fmean(self.output_lens),
            "output_len_min": min(self.output_lens),
            "output_len_max": max(self.output_lens),
            "corpus_tokens": self.corpus_tokens,
            "digest": self.digest,
        }


def make_workload(tokenizer, num_requests: int, seed: int) -> Workload:
    corpus = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]
    if len(corpus) <= PROMPT_LEN_RANGE[1]:
        raise RuntimeError(f"The corpus has only {len(corpus)} tokens.")
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        length = rng.randint(*PROMPT_LEN_RANGE)
        offset = rng.randrange(len(corpus) - length + 1)
        prompts.append(list(corpus[offset : offset + length]))
        output_lens.append(rng.randint(*OUTPUT_LEN_RANGE))
    digest = hashlib.sha256(json.dumps([prompts, output_lens]).encode()).hexdigest()[:16]
    return Workload(prompts, output_lens, len(corpus), digest)


# ---- timing --------------------------------------------------------------------------------------------------------
def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux ``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this process
    return usage.ru_utime + usage.ru_stime


class Timer:
    """Wall time of a block, plus how busy *other* processes kept the CPUs meanwhile: the benchmark
    needs the machine to itself, and ``foreign_cpu_share`` (0 = idle, 1 = all cores busy) says if it had it."""

    def __enter__(self) -> Timer:
        self._busy, self._own = _busy_cpu_seconds(), _own_cpu_seconds()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._start
        self.own_cpu_s = _own_cpu_seconds() - self._own
        busy = _busy_cpu_seconds()
        self.foreign_cpu_share: float | None = None
        if busy is not None and self._busy is not None:
            foreign = max(0.0, busy - self._busy - self.own_cpu_s)
            self.foreign_cpu_share = foreign / (self.wall_s * (os.cpu_count() or 1))

    def to_json(self) -> dict[str, Any]:
        return {"own_cpu_s": self.own_cpu_s, "foreign_cpu_share": self.foreign_cpu_share}


# ---- results -----------------------------------------------------------------------------------------------------
@dataclass
class SystemResult:
    name: str
    wall_s: float
    generated_tokens: int  # each request's own requested output tokens only
    processed_tokens: int  # prompt tokens + generated tokens (useful work; padding and waste excluded)
    outputs: list[list[int]] = field(repr=False)  # per request, cut to its requested length
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def generated_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s

    @property
    def processed_tok_s(self) -> float:
        return self.processed_tokens / self.wall_s

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "generated_tokens": self.generated_tokens,
            "processed_tokens": self.processed_tokens,
            "generated_tok_s": self.generated_tok_s,
            "processed_tok_s": self.processed_tok_s,
            **self.extra,
        }


def make_result(name: str, timer: Timer, workload: Workload, outputs: list[list[int]], **extra: Any) -> SystemResult:
    for i, (out, want) in enumerate(zip(outputs, workload.output_lens)):
        if len(out) != want:
            raise RuntimeError(f"{name}: request {i} produced {len(out)} tokens, expected {want}.")
    generated = sum(len(o) for o in outputs)
    return SystemResult(
        name, timer.wall_s, generated, workload.prompt_tokens + generated, outputs, {**extra, **timer.to_json()}
    )


def agreement(reference: Sequence[list[int]], other: Sequence[list[int]]) -> dict[str, float]:
    """Greedy-output agreement: identical requests and mean fraction of the common prefix."""
    same = sum(a == b for a, b in zip(reference, other))
    prefix = []
    for a, b in zip(reference, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), 1))
    return {"identical_requests": same / len(reference), "mean_common_prefix": statistics.fmean(prefix)}


def _git(directory: Path, *args: str) -> str:
    run = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True, timeout=30)
    return run.stdout.rstrip("\n")


def cb_serve_source() -> dict[str, Any]:
    """Which cb_serve was measured: its directory and, in a git checkout, the commit and modified files."""
    directory = Path(cb_serve.__file__).resolve().parent
    info: dict[str, Any] = {"path": str(directory)}
    try:
        info["commit"] = _git(directory, "rev-parse", "--short", "HEAD")
        info["modified"] = [line[3:] for line in _git(directory, "status", "--porcelain", "--", ".").splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout (e.g. an exported commit on PYTHONPATH)
    return info


def log(message: str) -> None:
    print(message, flush=True)


# ---- 1. cb-serve ---------------------------------------------------------------------------------------------------
def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def summarize_steps(steps: list[StepStats]) -> dict[str, Any]:
    with_prefill = [s for s in steps if s.num_prefill_tokens]
    decode_only = [s for s in steps if not s.num_prefill_tokens]
    return {
        "num_steps": len(steps),
        "mean_tokens_per_step": statistics.fmean(s.num_scheduled_tokens for s in steps),
        "mean_budget_fill": statistics.fmean(s.budget_fill for s in steps),
        "mean_seqs_per_step": statistics.fmean(s.num_seqs for s in steps),
        "max_seqs_per_step": max(s.num_seqs for s in steps),
        "steps_with_prefill": len(with_prefill),
        "decode_only_steps": len(decode_only),
        "mean_step_ms": 1e3 * statistics.fmean(s.duration_s for s in steps),
        "mean_prefill_step_ms": 1e3 * statistics.fmean(s.duration_s for s in with_prefill) if with_prefill else 0.0,
        "mean_decode_step_ms": 1e3 * statistics.fmean(s.duration_s for s in decode_only) if decode_only else 0.0,
        "mean_decode_step_seqs": statistics.fmean(s.num_seqs for s in decode_only) if decode_only else 0.0,
        "preempted_in_steps": sum(s.num_preempted for s in steps),
    }


def warmup_prompt(workload: Workload) -> list[int]:
    return workload.prompts[0][:16]


def run_cb_serve(llm: LLM, workload: Workload) -> SystemResult:
    engine = llm.engine
    llm.generate([warmup_prompt(workload)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), False)
    engine.block_manager.reset_prefix_cache()  # the warmup prompt must not become a prefix-cache hit
    steps: list[StepStats] = []
    engine.step_listeners.append(lambda stats, _outputs: steps.append(stats))
    before = engine.get_stats()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    with Timer() as timer:
        outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    engine.step_listeners.pop()
    after = engine.get_stats()
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return make_result(
        "cb-serve",
        timer,
        workload,
        token_ids,
        **summarize_steps(steps),
        preemptions=after.num_preemptions - before.num_preemptions,
        prefix_cache_hit_tokens=after.prefix_cache_hits - before.prefix_cache_hits,
        kv_blocks=engine.num_blocks,
        block_size=engine.block_size,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        max_num_seqs=engine.config.max_num_seqs,
    )


# ---- 2. HF static batching ----------------------------------------------------------------------------------------
def load_hf_model(source: loader.ModelSource, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **source.hf_kwargs())
    return model.eval().requires_grad_(False)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


@contextmanager
def eos_disabled(model) -> Iterator[None]:
    """No EOS stopping (greedy tokens stay unaltered, unlike with min_new_tokens). generate() fills an unset
    eos_token_id from the model's generation_config, so clear it there too: otherwise rows stop at EOS and
    are padded while the rest of the batch goes on."""
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def hf_static_batch(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, streamer=None) -> torch.Tensor:
    """One static left-padded greedy ``generate`` batch (inside ``eos_disabled``); the new tokens
    ``[len(prompts), max_new_tokens]``."""
    from transformers import GenerationConfig

    input_ids, mask = left_pad(prompts, pad_id)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id, use_cache=True
    )
    out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, streamer=streamer)
    return out[:, input_ids.shape[1] :]


@torch.inference_mode()
def run_hf_static(model, tokenizer, workload: Workload, batch_size: int) -> SystemResult:
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with eos_disabled(model):
        hf_static_batch(model, [warmup_prompt(workload)], 2, pad_id)
        outputs: list[list[int]] = []
        padding = wasted = 0
        with Timer() as timer:
            for b in range(0, workload.num_requests, batch_size):
                prompts = workload.prompts[b : b + batch_size]
                lens = workload.output_lens[b : b + batch_size]
                new = hf_static_batch(model, prompts, max(lens), pad_id)
                if new.shape[1] != max(lens):
                    raise RuntimeError(f"hf-static: generated {new.shape[1]} tokens, expected {max(lens)}.")
                outputs.extend(new[row, :n].tolist() for row, n in enumerate(lens))
                padding += sum(max(len(p) for p in prompts) - len(p) for p in prompts)
                wasted += sum(max(lens) - n for n in lens)
    return make_result(
        "hf-static",
        timer,
        workload,
        outputs,
        batch_size=batch_size,
        padding_tokens=padding,
        wasted_decode_tokens=wasted,
    )


# ---- 3. HF continuous batching ------------------------------------------------------------------------------------
def run_hf_continuous(model, workload: Workload, api: str) -> SystemResult:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    max_len = max(workload.output_lens)
    # eos_token_id=None: the continuous-batching manager then disables EOS (-1).
    config = GenerationConfig(max_new_tokens=max_len, do_sample=False, eos_token_id=None)
    if api == "generate_batch":
        # One max_new_tokens for every request: each generates max_len tokens, only its own count.
        with Timer() as timer:
            results = model.generate_batch(inputs=workload.prompts, generation_config=config, progress_bar=False)
        ordered = list(results.values())
        if len(ordered) != workload.num_requests:
            raise RuntimeError(f"hf-continuous: {len(ordered)} of {workload.num_requests} requests came back.")
        outputs = [list(r.generated_tokens)[:n] for r, n in zip(ordered, workload.output_lens)]
        wasted = workload.num_requests * max_len - workload.output_tokens
        return make_result(
            "hf-continuous", timer, workload, outputs, api=api, timed="generate_batch incl. warmup", wasted=wasted
        )

    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max_len,
        num_requests=workload.num_requests,
    )
    setup_start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=30, warmup=True, workload_hints=hints
    ) as manager:
        setup = time.perf_counter() - setup_start
        cb_config = manager.continuous_batching_config
        with Timer() as timer:
            ids = [
                manager.add_request(prompt, request_id=f"bench_{i}", max_new_tokens=n)
                for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens))
            ]
            results: dict[str, Any] = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"hf-continuous: request {result.request_id} failed: {result.error}")
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("hf-continuous: the generation thread died.")
    outputs = [list(results[i].generated_tokens) for i in ids]
    return make_result(
        "hf-continuous",
        timer,
        workload,
        outputs,
        api=api,
        timed="add_request..last result (manager setup + warmup excluded)",
        setup_and_warmup_s=setup,
        page_size=cb_config.page_size,
        num_blocks=cb_config.num_blocks,
        max_batch_tokens=cb_config.max_batch_tokens,
        max_requests_per_batch=cb_config.max_requests_per_batch,
        attn_implementation=model.config._attn_implementation,
    )


# ---- 4. roofline ---------------------------------------------------------------------------------------------------
@dataclass
class GemmShape:
    name: str
    k: int
    n: int
    count_per_token: int  # how many [1, k] x [k, n] products one token's forward needs

    @property
    def flop_per_token(self) -> int:
        return 2 * self.k * self.n * self.count_per_token


def model_gemm_shapes(hf_config) -> list[GemmShape]:
    """The matmuls of one token through a Llama-family model (as cb-serve fuses them) plus the LM head."""
    hidden, inter, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return [
        GemmShape("qkv_proj", hidden, q + 2 * kv, layers),
        GemmShape("o_proj", q, hidden, layers),
        GemmShape("gate_up_proj", hidden, 2 * inter, layers),
        GemmShape("down_proj", inter, hidden, layers),
        GemmShape("lm_head", hidden, hf_config.vocab_size, 1),
    ]


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


def measure_copy_bandwidth(num_bytes: int = 256 << 20, reps: int = 7) -> float:
    """GB/s (read + write) of a large tensor copy: what bounds decode steps, which stream all weights and KV."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * num_bytes / statistics.median(times) / 1e9


def measure_roofline(hf_config, dtype: torch.dtype) -> dict[str, Any]:
    shapes = model_gemm_shapes(hf_config)
    extra = GemmShape("gate_or_up", hf_config.hidden_size, hf_config.intermediate_size, 0)
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
        copy_gb_s = measure_copy_bandwidth()
    flop_per_token = sum(s.flop_per_token for s in shapes)
    # The model's mix: time per token = sum over shapes of its FLOP / its rate.
    seconds_per_token = sum(s.flop_per_token / (per_shape[s.name]["gflop_s"] * 1e9) for s in shapes)
    rate = flop_per_token / seconds_per_token
    return {
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "flop_per_token": flop_per_token,
        "matmul_params": flop_per_token // 2,
        "per_shape": per_shape,
        "model_mix_gflop_s": rate / 1e9,
        "roofline_tok_s": rate / flop_per_token,
        "memory_copy_gb_s": copy_gb_s,
        "foreign_cpu_share": timer.foreign_cpu_share,
    }


# ---- report --------------------------------------------------------------------------------------------------------
def print_system(result: SystemResult) -> None:
    log(
        f"[{result.name}] {result.generated_tokens} generated tokens in {result.wall_s:.1f} s: "
        f"{result.generated_tok_s:.1f} generated tok/s, {result.processed_tok_s:.1f} processed tok/s"
    )
    for key, value in result.extra.items():
        log(f"    {key}: {value:.3f}" if isinstance(value, float) else f"    {key}: {value}")


def report(workload: Workload, roofline: dict[str, Any], results: dict[str, SystemResult]) -> dict[str, Any]:
    processed = workload.prompt_tokens + workload.output_tokens
    rate = roofline["model_mix_gflop_s"] * 1e9
    workload_roofline = workload.output_tokens / (processed * roofline["flop_per_token"] / rate)
    roofline["workload_roofline_generated_tok_s"] = workload_roofline
    log("")
    log(f"== roofline ({roofline['dtype']} GEMM, M={GEMM_M}, {roofline['threads']} threads) ==")
    for name, s in roofline["per_shape"].items():
        log(f"    {name:13s} [{s['m']}, {s['k']}] x [{s['k']}, {s['n']}]: {s['gflop_s']:.1f} GFLOP/s")
    log(f"    FLOP/token (matmuls incl. LM head): {roofline['flop_per_token'] / 1e9:.4f} GFLOP")
    log(f"    model-mix GEMM rate: {roofline['model_mix_gflop_s']:.1f} GFLOP/s")
    log(f"    memory bandwidth (256 MB tensor copy, read + write): {roofline['memory_copy_gb_s']:.1f} GB/s")
    log(f"    roofline: {roofline['roofline_tok_s']:.1f} processed tok/s")
    log(f"    workload roofline: {workload_roofline:.1f} generated tok/s ({processed} processed tokens)")
    log("")
    header = ("wall s", "gen tok/s", "proc tok/s", "of roofline", "foreign CPU")
    log(f"{'system':15s} {header[0]:>8s} {header[1]:>10s} {header[2]:>11s} {header[3]:>12s} {header[4]:>12s}")
    for r in results.values():
        frac = r.generated_tok_s / workload_roofline
        foreign = r.extra.get("foreign_cpu_share")
        busy = "n/a" if foreign is None else f"{foreign:.1%}"
        log(
            f"{r.name:15s} {r.wall_s:8.1f} {r.generated_tok_s:10.1f} {r.processed_tok_s:11.1f} {frac:12.1%} {busy:>12s}"
        )
    shares = [r.extra.get("foreign_cpu_share") or 0.0 for r in results.values()] + [
        roofline["foreign_cpu_share"] or 0.0
    ]
    if max(shares) > CONTENTION_WARNING:
        log(
            f"WARNING: other processes kept up to {max(shares):.0%} of the CPUs busy during a measurement; "
            "the numbers above are not representative (rerun on an idle machine)."
        )
    ratios: dict[str, float] = {}
    cb = results.get("cb-serve")
    if cb is not None:
        ratios["cb_serve_fraction_of_roofline"] = cb.generated_tok_s / workload_roofline
        for other in ("hf-static", "hf-continuous"):
            if other in results:
                ratio = ratios["cb_serve_over_" + other.replace("-", "_")] = (
                    cb.generated_tok_s / results[other].generated_tok_s
                )
                agree = agreement(cb.outputs, results[other].outputs)
                results[other].extra.update({f"agreement_with_cb_serve_{k}": v for k, v in agree.items()})
                log(
                    f"cb-serve / {other}: {ratio:.2f}x "
                    f"(greedy outputs identical for {agree['identical_requests']:.0%} of requests, "
                    f"mean common prefix {agree['mean_common_prefix']:.0%})"
                )
        log(f"cb-serve fraction of the workload roofline: {ratios['cb_serve_fraction_of_roofline']:.1%}")
    return {"roofline": roofline, "ratios": ratios}


# ---- main ----------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve"
    )
    EngineConfig.add_cli_args(parser)  # cb-serve's engine arguments; --seed below also seeds the engine
    parser.add_argument("--num-requests", type=int, default=64, help="Number of requests (default: 64).")
    parser.add_argument("--seed", type=int, default=0, help="Workload (and engine) seed (default: 0).")
    parser.add_argument("--skip-hf", action="store_true", help="Only cb-serve and the roofline.")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"Comma-separated systems to run (default: {','.join(SYSTEMS)}); the roofline always runs.",
    )
    parser.add_argument(
        "--hf-cb-api",
        choices=["manager", "generate_batch"],
        default="manager",
        help="HF continuous batching through the manager with per-request max_new_tokens (default), or "
        "generate_batch with the largest output length for every request.",
    )
    parser.add_argument("--json", metavar="OUT", help="Write the results as JSON to OUT.")
    return parser.parse_args(argv)


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
    engine = llm.engine
    workload = make_workload(engine.tokenizer, args.num_requests, args.seed)
    log(f"workload: {json.dumps(workload.summary())}")

    systems = ["cb-serve"] if args.skip_hf else args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"Unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}.")
    roofline = measure_roofline(engine.hf_config, engine.dtype)
    results: dict[str, SystemResult] = {}
    if "cb-serve" in systems:
        results["cb-serve"] = run_cb_serve(llm, workload)
        print_system(results["cb-serve"])

    errors: dict[str, str] = {}
    if "hf-static" in systems or "hf-continuous" in systems:
        model_source, tokenizer, dtype = engine.source, engine.tokenizer, engine.dtype
        del llm, engine
        gc.collect()
        model = load_hf_model(model_source, dtype)
    if "hf-static" in systems:
        results["hf-static"] = run_hf_static(model, tokenizer, workload, HF_STATIC_BATCH_SIZE)
        print_system(results["hf-static"])
    if "hf-continuous" in systems:
        try:
            results["hf-continuous"] = run_hf_continuous(model, workload, args.hf_cb_api)
            print_system(results["hf-continuous"])
        except Exception as e:  # reported, not fatal: the other numbers still stand
            log(f"[hf-continuous] failed: {type(e).__name__}: {e}")
            results.pop("hf-continuous", None)
            errors["hf-continuous"] = f"{type(e).__name__}: {e}"

    summary = report(workload, roofline, results)
    out = {
        "started": started,
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cb_serve": source,
        "engine_args": engine_kwargs(args),
        "workload": workload.summary(),
        "systems": {name: r.to_json() for name, r in results.items()},
        **summary,
        "errors": errors,
    }
    write_json(args.json, out)
    return out


def write_json(path: str | None, out: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
