"""Speculative decoding (n-gram) against none, in one process on one machine: an input-grounded
workload (summarize, rewrite, comment or proofread a given standard-library docstring or function)
and a chat workload (general questions), each at concurrency 1, 8 and 64 (closed loop: a new
request as soon as one ends), each with no speculation, fixed ``k`` (vLLM's behaviour) and the
adaptive policy. Greedy, so every mode emits the same tokens (checked); each request's
``max_tokens`` is drawn from a range (seeded), so the closed loop does not run in lockstep waves.

    .venv/bin/python bench/spec_bench.py --out spec.json        # ~15 min on 2 cores

Reports per run: output tokens per second, mean inter-token latency per request (ITL: (last token
time - first token time) / (tokens - 1), several tokens of one step share a time), TTFT, and the
acceptance rate (accepted / drafted tokens).
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
import textwrap
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from cb_serve import LLM, SamplingParams, StepStats
from cb_serve.benchmarks.cpu_accounting import Timer
from cb_serve.benchmarks.report import log, run_info, write_json
from cb_serve.benchmarks.workload import CORPUS_MODULES
from cb_serve.cpu_ops import cpu_model_and_flags

CHAT_QUESTIONS = (
    "What are three good habits for staying healthy while working from home?",
    "Explain the difference between weather and climate to a ten-year-old.",
    "Give me a short recipe for a vegetarian pasta dinner.",
    "How do I politely decline a meeting invitation from my manager?",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Write a short poem about the ocean at night.",
    "Why is the sky blue?",
    "What are the pros and cons of electric cars?",
    "How can I improve my sleep?",
    "Suggest a name for a small coffee shop near a university.",
    "What is the difference between a virus and a bacterium?",
    "How do I start learning to play the guitar?",
    "Explain what inflation is in simple terms.",
    "Write a friendly email inviting my neighbours to a garden party.",
    "What are some tips for a successful job interview?",
    "How does a rainbow form?",
    "What is photosynthesis?",
    "Give me five ideas for a birthday present for my father.",
    "How do I make my houseplants grow better?",
    "What is the capital of Australia, and why is it not Sydney?",
    "Explain how a bicycle stays upright.",
    "What are the benefits of reading books every day?",
    "How can I save money on groceries?",
    "Describe a typical day in the life of a honeybee.",
    "What is the best way to learn a new language as an adult?",
    "Write a short story about a robot who wants to become a painter.",
    "What causes earthquakes?",
    "How do I write a good cover letter?",
    "What are the main differences between cats and dogs as pets?",
    "Explain the rules of chess in a few sentences.",
    "What is a healthy breakfast I can make in five minutes?",
    "Why do leaves change colour in autumn?",
)

TASKS = (
    "Summarize the following documentation in a few sentences:\n\n{text}",
    "Rewrite the following text in plain English:\n\n{text}",
    "Fix the spelling in this text and return it in full:\n\n{text}",
    "Add comments to the following Python function and return the full code:\n\n{code}",
)


def grounded_texts(limit: int) -> list[tuple[str, str]]:
    """(docstring, source) pairs of standard-library functions, in a fixed order: real text."""
    found = []
    for name in CORPUS_MODULES:
        module = __import__(name, fromlist=["_"])
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            doc = inspect.getdoc(obj) or ""
            try:
                source = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if 300 <= len(doc) and 300 <= len(source) <= 2500:
                found.append((doc[:1200], source))
    return found[:limit]


def input_grounded_messages(n: int) -> list[str]:
    texts = grounded_texts(n)
    out = []
    for i in range(n):
        doc, source = texts[i % len(texts)]
        task = TASKS[i % len(TASKS)]
        if "{code}" in task:
            out.append(task.format(code=source))
        elif "spelling" in task:
            out.append(task.format(text=doc.replace(" the ", " teh ").replace("tion", "toin")))
        else:
            out.append(task.format(text=doc))
    return out


def chat_prompts(tokenizer, messages: list[str]) -> list[str]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        for m in messages
    ]


def run_closed_loop(llm: LLM, prompts: list[str], params: list[SamplingParams], concurrency: int) -> dict[str, Any]:
    """All ``prompts`` through the engine with ``concurrency`` requests in flight at a time."""
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    steps: list[StepStats] = []

    def listener(stats: StepStats, _outputs: object) -> None:
        steps.append(stats)

    pending = deque(enumerate(prompts))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    in_flight = 0
    engine.add_step_listener(listener)
    try:
        with Timer() as timer:
            while pending or engine.has_unfinished_requests():
                while pending and in_flight < concurrency:
                    i, prompt = pending.popleft()
                    added[str(i)] = time.perf_counter()
                    engine.add_request(str(i), prompt, params[i])
                    in_flight += 1
                outputs = engine.step()
                now = time.perf_counter()
                for out in outputs:
                    ids = out.outputs[0].token_ids
                    if len(ids) > len(tokens.get(out.request_id, ())):
                        first.setdefault(out.request_id, now)
                        last[out.request_id] = now
                        tokens[out.request_id] = list(ids)
                    in_flight -= out.finished
    finally:
        engine.remove_step_listener(listener)
    itl = [(last[r] - first[r]) / (len(t) - 1) for r, t in tokens.items() if len(t) > 1]
    drafted = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    decode_steps = [s for s in steps if not s.num_prefill_tokens]
    num_out = sum(len(t) for t in tokens.values())
    return {
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "output_tokens": num_out,
        "seconds": timer.wall_s,
        "foreign_cpu_share": timer.foreign_cpu_share,
        "tokens_per_s": num_out / timer.wall_s,
        "itl_ms_mean": 1e3 * statistics.fmean(itl),
        "itl_ms_median": 1e3 * statistics.median(itl),
        "ttft_ms_mean": 1e3 * statistics.fmean(first[r] - added[r] for r in first),
        "num_steps": len(steps),
        "mean_decode_step_ms": 1e3 * statistics.fmean(s.duration_s for s in decode_steps) if decode_steps else 0.0,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens_per_step": drafted / len(steps),
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--requests", default="6,24,128", help="requests per concurrency level")
    p.add_argument("--max-tokens", default="32-160", help="each request's, drawn uniformly from this range (seeded)")
    p.add_argument("--workloads", default="input_grounded,chat")
    p.add_argument("--modes", default="off,fixed,adaptive")
    p.add_argument("--repeats", type=int, default=1, help="runs of each level, modes interleaved")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    engine_args = dict(max_num_seqs=64, max_num_batched_tokens=2048, num_gpu_blocks=4096, max_model_len=2048)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    modes = args.modes.split(",")
    llms = {
        "off": lambda: LLM(args.model, **engine_args),
        "fixed": lambda: LLM(args.model, speculative_config={**spec, "adaptive": False}, **engine_args),
        "adaptive": lambda: LLM(args.model, speculative_config=spec, **engine_args),
    }
    built = {m: llms[m]() for m in modes}
    tokenizer = built[modes[0]].get_tokenizer()
    levels = list(zip((int(c) for c in args.concurrency.split(",")), (int(n) for n in args.requests.split(","))))
    workloads = {
        "input_grounded": chat_prompts(tokenizer, input_grounded_messages(max(n for _, n in levels))),
        "chat": chat_prompts(tokenizer, list(CHAT_QUESTIONS)),
    }
    low, _, high = args.max_tokens.partition("-")
    rng = random.Random(0)
    max_tokens = [rng.randint(int(low), int(high or low)) for _ in range(max(n for _, n in levels))]
    for llm in built.values():  # untimed warmup: lazy initialization, and a first measured step cost
        llm.generate(workloads["chat"][:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    runs = []
    reference: dict[tuple[str, int], list[list[int]]] = {}  # greedy: speculation must not change a token
    for name in args.workloads.split(","):
        base = workloads[name]
        for concurrency, n in levels:
            prompts = [base[i % len(base)] for i in range(n)]
            params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens[:n]]
            for repeat in range(args.repeats):
                for mode in modes:
                    r = run_closed_loop(built[mode], prompts, params, concurrency)
                    got = r.pop("tokens")
                    same = got == reference.setdefault((name, concurrency), got)
                    r.update(workload=name, mode=mode, repeat=repeat, same_tokens=same)
                    log(
                        f"{name} c={concurrency} {mode}: {r['tokens_per_s']:.1f} tok/s, ITL {r['itl_ms_mean']:.1f} ms, "
                        f"accepted {r['accepted_tokens']}/{r['draft_tokens']}, foreign cpu {r['foreign_cpu_share']:.1%}"
                    )
                    runs.append(r)
    model, flags = cpu_model_and_flags()
    cpu = {"model": model, "amx": "amx_tile" in flags, "avx512_bf16": "avx512_bf16" in flags}
    out = {"run": run_info(started), "cpu": cpu, "args": vars(args), "engine_args": engine_args, "runs": runs}
    write_json(args.out, out)
    print(json.dumps(runs, indent=1))
    return 0 if all(r["same_tokens"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
