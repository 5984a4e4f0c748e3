"""Multi-turn chat benchmark of the request routers (issue 14): one seeded trace of conversations
that share a system prompt and grow each turn, served by N engine replicas under each routing
policy in turn, plus one replica holding the whole cache as the hit-rate reference.

Trace: ``--conversations`` conversations of ``--turns`` turns. Every conversation starts with the
same ~``--system-tokens`` system prompt; each turn adds a user message (~60 tokens) and, before
the next turn, the assistant message of the trace (~60 tokens: the client sends its history, as
chat clients do; the model's own reply is generated and discarded, like a re-tokenized history).
All text is real (``workload.corpus_text``). Conversations start as a Poisson process at
``--rate`` per second; between turns a user thinks for a uniform [1, 3] s. Every request streams
``--max-tokens`` tokens (``ignore_eos``) with ``include_usage``.

Policies (``--policies``):
  pow2         Ray Serve's default ``PowerOfTwoChoicesRequestRouter`` (queue length of two random replicas)
  load         cb-serve's ``KVCacheAwareRouter`` with ``prefix_weight=0``: load only (the router before issue 14)
  prefix-tree  Ray Serve LLM's ``PrefixCacheAffinityRouter`` (approximate character prefix tree of what it
               sent where; it reads the ``messages`` attribute of ``ChatEngineRequest``)
  kv-aware     cb-serve's ``KVCacheAwareRouter`` as configured by default
  single       one replica (any router): the hit rate of a single cache holding everything

Per policy: prefix-cache hit rate (sum of ``cached_tokens`` / sum of prompt tokens, from the
responses' usage), TTFT p50 / p99 at the client, end-to-end output-token throughput, requests
per replica and their largest deviation from even.

The model is a random-weight Llama (``--hidden``, ``--layers``) with SmolLM2's tokenizer and chat
template, so 4 replicas fit on two cores; each replica gets one torch thread and the same KV
cache (``--num-blocks``), large enough that the single replica holds the whole trace.

Run from the repository root:
    .venv/bin/python bench/multiturn.py --replicas 2 --out bench/results/multiturn_r2.json
    .venv/bin/python bench/multiturn.py --replicas 4 --out bench/results/multiturn_r4.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cb_serve.benchmarks.report import cb_serve_source, log, write_json  # noqa: E402
from cb_serve.benchmarks.serving_client import greedy_stream_body  # noqa: E402
from cb_serve.benchmarks.workload import corpus_text  # noqa: E402

ROUTERS = {
    "pow2": {"request_router_class": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"},
    "load": {"prefix_weight": 0.0, "session_affinity": False},
    # ray.serve.llm re-exports it but imports pyarrow (ray[llm]); the class itself needs only Ray Serve.
    "prefix-tree": {
        "request_router_class": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
        ":PrefixCacheAffinityRouter"
    },
    "kv-aware": {},
    "single": {},
}
PORT = 8331


@dataclass
class Turn:
    conversation: int
    turn: int
    replica: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def make_trace(args: argparse.Namespace, tokenizer) -> dict[str, Any]:
    """The system prompt, per conversation its user and assistant messages, start times and think times."""
    words = corpus_text().split()
    rng = random.Random(args.seed)

    def text(num_tokens: int) -> str:
        start = rng.randrange(len(words) - 4 * num_tokens)
        ids = tokenizer(" ".join(words[start : start + 2 * num_tokens]), add_special_tokens=False)["input_ids"]
        return tokenizer.decode(ids[:num_tokens]).strip()

    system = text(args.system_tokens)
    conversations = [
        {"user": [text(60) for _ in range(args.turns)], "assistant": [text(60) for _ in range(args.turns)]}
        for _ in range(args.conversations)
    ]
    starts, t = [], 0.0
    for _ in range(args.conversations):
        starts.append(t)
        t += rng.expovariate(args.rate)
    thinks = [[rng.uniform(1.0, 3.0) for _ in range(args.turns)] for _ in range(args.conversations)]
    return {"system": system, "conversations": conversations, "starts": starts, "thinks": thinks}


def messages_for(trace: dict[str, Any], c: int, turn: int) -> list[dict[str, str]]:
    conv = trace["conversations"][c]
    messages = [{"role": "system", "content": trace["system"]}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": conv["user"][t]})
        if t < turn:
            messages.append({"role": "assistant", "content": conv["assistant"][t]})
    return messages


async def one_turn(client: httpx.AsyncClient, messages: list[dict], max_tokens: int, result: Turn) -> None:
    body = greedy_stream_body("bench", max_tokens, messages=messages)
    start = time.monotonic()
    async with client.stream("POST", f"http://127.0.0.1:{PORT}/v1/chat/completions", json=body) as r:
        result.replica = r.headers.get("x-cb-replica", "")
        if r.status_code != 200:
            result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and not result.ttft_s:
                result.ttft_s = time.monotonic() - start
            if event.get("usage"):
                usage = event["usage"]
                result.prompt_tokens = usage["prompt_tokens"]
                result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                result.output_tokens = usage["completion_tokens"]
    result.latency_s = time.monotonic() - start


async def run_trace(trace: dict[str, Any], args: argparse.Namespace) -> tuple[list[Turn], float]:
    results: list[Turn] = []

    async def conversation(client: httpx.AsyncClient, c: int, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + trace["starts"][c] - time.monotonic()))
        for turn in range(args.turns):
            result = Turn(c, turn)
            results.append(result)
            await one_turn(client, messages_for(trace, c, turn), args.max_tokens, result)
            await asyncio.sleep(trace["thinks"][c][turn])

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(conversation(client, c, t0) for c in range(args.conversations)))
        wall = (
            time.monotonic() - t0 - min(trace["thinks"][c][-1] for c in range(args.conversations))
        )  # not the last think
    return results, wall


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(results: list[Turn], wall_s: float, replicas: int) -> dict[str, Any]:
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft_s for r in ok]
    per_replica = Counter(r.replica for r in ok)
    even = len(ok) / replicas
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "output_tok_s": sum(r.output_tokens for r in ok) / wall_s,
        "wall_s": wall_s,
        "per_replica": sorted(per_replica.values(), reverse=True),
        "max_deviation_from_even": max(
            abs(n - even) for n in [*per_replica.values(), *[0] * (replicas - len(per_replica))]
        )
        / even,
    }


def app_args(args: argparse.Namespace, model_dir: Path, policy: str) -> dict[str, Any]:
    replicas = 1 if policy == "single" else args.replicas
    return {
        "model": str(model_dir),
        "engine": {
            "max_model_len": 2048,
            "num_gpu_blocks": args.num_blocks,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 512,
            "num_threads": 1,
        },
        "routing_stats_period_s": 0.5,
        "routing": {
            **ROUTERS[policy],
            **(
                {"imbalance_threshold": args.imbalance_threshold}
                if policy == "kv-aware" and args.imbalance_threshold
                else {}
            ),
        },
        "engine_replica": {"num_replicas": replicas, "ray_actor_options": {"num_cpus": 1}},
        "router": {"served_model_name": "bench"},
    }


def make_model(directory: Path, tokenizer, args: argparse.Namespace) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    heads = args.hidden // 64
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="pow2,load,prefix-tree,kv-aware,single")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=2.0, help="conversation starts per second")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=2560)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--imbalance-threshold", type=float, help="kv-aware's (default: cb-serve's default)")
    p.add_argument("--out")
    args = p.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray's logging setup would print every request

    import ray
    from ray import serve

    from cb_serve.model_executor.loader import default_model_source, load_tokenizer
    from cb_serve.serve.app import build_app

    tokenizer = load_tokenizer(default_model_source())
    trace = make_trace(args, tokenizer)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    out: dict[str, Any] = {"started": started, "command": " ".join(sys.argv), "cb_serve": cb_serve_source()}
    out["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    out["amx"] = "amx_tile" in open("/proc/cpuinfo").read()
    out["args"] = vars(args)
    out["policies"] = {}
    env = {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", tokenizer, args)
        ray.init(
            num_cpus=args.replicas + 2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env}
        )
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        try:
            for policy in args.policies.split(","):
                serve.run(build_app(app_args(args, model_dir, policy)), name=f"mt-{policy}", route_prefix="/")
                log(f"{policy}: serving; warming up")
                asyncio.run(warm_up(trace, args))
                results, wall = asyncio.run(run_trace(trace, args))
                summary = summarize(results, wall, 1 if policy == "single" else args.replicas)
                out["policies"][policy] = {"summary": summary, "turns": [asdict(r) for r in results]}
                log(f"{policy}: {json.dumps(summary)}")
                serve.delete(f"mt-{policy}")
        finally:
            serve.shutdown()
            ray.shutdown()
    log(table(out["policies"]))
    write_json(args.out, out)


async def warm_up(trace: dict[str, Any], args: argparse.Namespace) -> None:
    """A few unrelated requests per replica (nothing shares a block with the trace)."""
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(2 * args.replicas):
            await one_turn(client, [{"role": "user", "content": f"warm up {i} " * 20}], 4, Turn(-1, i))


def table(policies: dict[str, Any]) -> str:
    lines = [
        "| policy | hit rate | TTFT p50 (s) | TTFT p99 (s) | output tok/s | requests per replica | max dev. |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, p in policies.items():
        s = p["summary"]
        lines.append(
            f"| {name} | {s['hit_rate']:.1%} | {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} | "
            f"{s['output_tok_s']:.1f} | {'/'.join(map(str, s['per_replica']))} | {s['max_deviation_from_even']:.0%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
