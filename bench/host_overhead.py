"""Host overhead of an engine step per sequence, on the CPU: the real scheduler, model runner, sampler
and output path (incremental detokenization, stop checks, outputs), with a model whose forward costs
almost nothing. What a GPU hides behind its kernels, and what bounds a small model anywhere, is this
host time: it is measured here without the model's own arithmetic in the way.

The model is a tiny random Llama with the built-in model's tokenizer (so detokenization is real), loaded as
any model is; then its forward returns zeros and its LM head fixed logits whose first maximum is one
ordinary word (` the`): every step decodes, detokenizes and checks stops as usual. Greedy, EOS ignored.

For each batch size R (``--rows``): R requests with 32-token prompts and ``--max-tokens`` output tokens,
all at once; the decode-only steps that ran all R sequences are timed by the engine itself
(``StepStats``: schedule, prepare, execute, output; the front end's text and outputs are made after the
step, so only the wall figures count them). Reported per R: the median and mean ms per step
(the mean with the garbage collector's pauses), **host µs per sequence per step** (median step time / R),
and each phase's share; and the marginal cost, the slope of step time over
R between the smallest and largest R. Two paths: ``LLM.generate`` (offline) and serving, ``AsyncLLM``
with ``--streams`` concurrent streams read by asyncio consumers, as a Ray Serve replica reads them, where
the wall time per token of a stream (its inter-token latency) counts delivery to the consumers too.

Run from the repository root on an otherwise idle machine (about 1 minute):
    .venv/bin/python bench/host_overhead.py --json bench/results/host_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from cb_offline import greedy, recording_steps
from step_phases import PHASES

from cb_serve import LLM, AsyncLLM, EngineConfig, StepStats
from cb_serve.benchmarks.cpu_accounting import Timer
from cb_serve.benchmarks.report import cb_serve_source, log, run_info, write_json
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.model_executor.loader import default_model_source, load_tokenizer

PROMPT_LEN = 32
WORD = " the"


def tiny_model(directory: Path) -> tuple[Path, int]:
    """A 2-layer random Llama (hidden 64) with the built-in model's tokenizer, saved in ``directory``;
    and the id of the token every step emits."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = load_tokenizer(default_model_source())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (token,) = tokenizer.encode(WORD, add_special_tokens=False)
    return directory, token


def stub_the_model(engine: Any, token: int, max_rows: int) -> None:
    """The loaded model's forward returns zeros, its logits and greedy head the fixed ``token`` (for up to
    ``max_rows`` sampled rows a step)."""
    model = engine.runner.model
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    logits = torch.zeros(max_rows, vocab)
    logits[:, token] = 1.0
    ids = torch.full((max_rows,), token, dtype=torch.long)
    model.forward = lambda input_ids, positions, kv_caches, meta: torch.zeros(input_ids.shape[0], hidden)
    model.compute_logits = lambda hidden: logits[: hidden.shape[0]]
    model.greedy_token_ids = lambda hidden: ids[: hidden.shape[0]]


def prompts(rows: int, token: int, length: int = PROMPT_LEN) -> list[dict[str, list[int]]]:
    """``rows`` prompts of ``length`` token ids, each distinct (no prefix-cache hits between them)."""
    return [{"prompt_token_ids": [1000 + i % 30000, *[token] * (length - 1)]} for i in range(rows)]


def full_decode_steps(steps: list[StepStats], rows: int) -> list[StepStats]:
    return [s for s in steps if not s.num_prefill_tokens and s.num_seqs == rows]


def summary(steps: list[StepStats], rows: int) -> dict[str, Any]:
    """The full-batch decode steps' median time, host µs per sequence and each phase's mean share."""
    full = full_decode_steps(steps, rows)
    assert full, f"no decode step ran all {rows} sequences"
    step_ms = statistics.median(s.duration_s for s in full) * 1e3
    total = sum(s.duration_s for s in full)
    shares = {p: round(sum(getattr(s.phases, f"{p}_s") for s in full) / total, 3) for p in PHASES}
    return {
        "rows": rows,
        "steps": len(full),
        "step_ms": round(step_ms, 3),
        "mean_step_ms": round(total * 1e3 / len(full), 3),  # with the collector's pauses
        "us_per_seq_per_step": round(step_ms * 1e3 / rows, 2),
        "phase_share": shares,
    }


def offline(llm: LLM, token: int, rows: int, max_tokens: int, prompt_len: int) -> dict[str, Any]:
    llm.generate(prompts(rows, token, prompt_len), greedy(4), use_tqdm=False)  # warm-up at this size
    with recording_steps(llm) as steps, Timer() as timer:
        llm.generate(prompts(rows, token, prompt_len), greedy(max_tokens), use_tqdm=False)
    wall_us = round(timer.wall_s * 1e6 / len(steps) / rows, 2)  # under async scheduling, steps overlap: the wall
    return {**summary(steps, rows), "wall_s": round(timer.wall_s, 3), "wall_us_per_seq_per_step": wall_us,
            **timer.to_json()}  # fmt: skip


async def serve_streams(engine: AsyncLLM, token: int, streams: int, max_tokens: int, prompt_len: int) -> float:
    """``streams`` concurrent requests, each read to the end by its own consumer; the wall seconds."""

    async def one(i: int, prompt: dict) -> int:
        n = 0
        async for out in engine.generate(prompt, greedy(max_tokens), f"r{i}-{time.monotonic_ns()}"):
            n += len(out.outputs[0].token_ids)
        return n

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(streams, token, prompt_len))))
    return time.perf_counter() - start


def serving(
    model_dir: Path, token: int, streams: int, max_tokens: int, prompt_len: int, engine_args: dict
) -> dict[str, Any]:
    engine = AsyncLLM(EngineConfig.from_kwargs(model=str(model_dir), **engine_args))
    try:
        stub_the_model(engine.engine, token, engine_args["max_num_seqs"])
        asyncio.run(serve_streams(engine, token, streams, 4, prompt_len))
        steps: list[StepStats] = []
        engine.add_step_listener(lambda stats, _outputs: steps.append(stats))
        with Timer() as timer:
            wall = asyncio.run(serve_streams(engine, token, streams, max_tokens, prompt_len))
        itl = {"wall_ms_per_token": round(wall * 1e3 / max_tokens, 3)}  # each stream's inter-token latency
        return {**summary(steps, streams), "wall_s": round(wall, 3), **itl, **timer.to_json()}
    finally:
        engine.shutdown()


def slope_us(results: list[dict[str, Any]]) -> float:
    """Marginal host µs per added sequence per step, between the smallest and largest batch."""
    first, last = results[0], results[-1]
    return round((last["step_ms"] - first["step_ms"]) * 1e3 / (last["rows"] - first["rows"]), 2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,64,256", help="batch sizes (default: 1,16,64,256)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--streams", type=int, default=64, help="concurrent AsyncLLM streams (default: 64)")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help=f"prompt tokens (default: {PROMPT_LEN})")
    p.add_argument("--async-scheduling", action="store_true", help="launch each step ahead (async scheduling)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows = sorted(int(r) for r in args.rows.split(","))
    max_seqs, max_len = max(rows + [args.streams]), args.prompt_len + args.max_tokens
    engine_args = dict(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(4096, max_seqs * args.prompt_len),  # every prompt in one step
        num_gpu_blocks=max(8192, max_seqs * (-(-max_len // 16) + 1)),
        max_model_len=max(1024, max_len),
        enable_prefix_caching=True,  # the default (prompts differ: no hits)
        seed=0,
        async_scheduling=args.async_scheduling,
    )
    log(f"host overhead, {started}: {cpu_model_and_flags()[0]}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, token = tiny_model(Path(tmp))
        llm = LLM(model=str(model_dir), **engine_args)
        stub_the_model(llm.engine, token, engine_args["max_num_seqs"])
        results = [offline(llm, token, r, args.max_tokens, args.prompt_len) for r in rows]
        del llm
        serve = serving(model_dir, token, args.streams, args.max_tokens, args.prompt_len, engine_args)
    out = {
        **run_info(started),
        "cpu": cpu_model_and_flags()[0],
        "threads": torch.get_num_threads(),
        "cb_serve": cb_serve_source(),
        "engine_args": engine_args,
        "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
        "offline": results,
        "offline_marginal_us_per_seq": slope_us(results),
        "serving": serve,
    }
    log(
        "path      rows  steps  step ms  mean ms  host µs/seq/step  wall µs/seq/step  "
        "schedule  prepare  execute  output"
    )
    for r in [*results, {**serve, "path": "serving"}]:
        shares = "  ".join(f"{r['phase_share'][p]:7.1%}" for p in PHASES)
        log(f"{r.get('path', 'offline'):8} {r['rows']:5} {r['steps']:6} {r['step_ms']:8.2f} {r['mean_step_ms']:8.2f} "
            f"{r['us_per_seq_per_step']:17.2f} {r.get('wall_us_per_seq_per_step', ''):>17}  {shares}")  # fmt: skip
    log(f"offline marginal cost: {out['offline_marginal_us_per_seq']} µs per added sequence per step")
    log(f"serving: {serve['wall_ms_per_token']} ms per token per stream at {args.streams} streams (wall)")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
