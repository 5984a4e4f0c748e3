"""The FP8 KV cache against a bf16 one (issue 53, acceptance 3): greedy agreement and logprob deltas on the real
models, and the blocks each holds in the same memory.

For each model (the built-in SmolLM2-135M-Instruct and Gemma 3 270M by default), float32 weights, the CPU
backend, ``--num-prompts`` (32) text prompts:

- **capacity:** the KV blocks a ``--kv-cache-memory`` (256 MiB) cache holds with ``kv_cache_dtype`` float32
  (``auto``), ``bfloat16`` and ``fp8``;
- **greedy agreement:** ``--max-tokens`` (64) greedy tokens with each cache; per cache against bf16's: the
  sequences identical to the end, the mean length of the common prefix, the first-token agreement;
- **logprob deltas:** each prompt followed by bf16's greedy output, read teacher-forced (``prompt_logprobs``)
  in chunks of ``--chunk`` (32) tokens, so every later chunk attends over the cache's stored K/V: at each
  continuation position, |logprob(fp8) - logprob(bf16)| of the same token (mean, 99th percentile, max), and
  float32's against bf16's for scale.

    .venv/bin/python bench/kv_cache_fp8.py --out bench/results/kv_cache_fp8.json   # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import statistics

from cb_serve import LLM, SamplingParams
from cb_serve.benchmarks.report import log, run_info, write_json

CACHES = ("auto", "bfloat16", "fp8")
SUBJECTS = [
    "the history of the printing press", "how a refrigerator works", "the rules of chess", "photosynthesis",
    "why the sky is blue", "the water cycle", "how vaccines train the immune system", "the Roman Empire's roads",
    "what a compiler does", "how bees communicate", "the causes of the seasons", "how a bicycle stays upright",
    "the life of a star", "how bread rises", "what inflation is", "how tides work", "the invention of the telephone",
    "how a neural network learns", "the structure of DNA", "why cats purr", "how glaciers move",
    "the origins of jazz", "how a battery stores energy", "what black holes are", "how paper is made",
    "the migration of monarch butterflies", "how a bill becomes a law", "the physics of rainbows",
    "how coffee is roasted", "why leaves change color", "the first moon landing", "how earthquakes happen",
]  # fmt: skip


def prompts(n: int) -> list[str]:
    return [f"Write a short, clear explanation of {SUBJECTS[i % len(SUBJECTS)]}." for i in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def continuation_logprobs(llm: LLM, ids: list[list[int]], starts: list[int]) -> list[list[float]]:
    """Teacher-forced: each prompt's logprobs of its own tokens from ``starts[i]`` on."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    return [[o.prompt_logprobs[j][p[j]].logprob for j in range(s, len(p))] for o, p, s in zip(outs, ids, starts)]


def deltas(a: list[list[float]], b: list[list[float]]) -> dict[str, float]:
    d = sorted(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return {"mean": statistics.fmean(d), "p99": d[int(0.99 * (len(d) - 1))], "max": d[-1], "positions": len(d)}


def run_model(model: str, args) -> dict:
    texts = prompts(args.num_prompts)
    engine = dict(max_model_len=1024, attention_backend="cpu", kv_cache_memory=args.kv_cache_memory << 20)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out: dict = {"model": model, "blocks": {}, "greedy": {}, "logprob_delta_vs_bfloat16": {}}
    tokens, prompt_ids = {}, None
    for kv in CACHES:
        llm = LLM(model, kv_cache_dtype=kv, **engine)
        out["blocks"][kv] = llm.engine.num_blocks
        results = llm.generate(texts, greedy, use_tqdm=False)
        tokens[kv] = [list(r.outputs[0].token_ids) for r in results]
        prompt_ids = [list(r.prompt_token_ids) for r in results]
        del llm
    for kv in ("auto", "fp8"):
        prefix = [common_prefix(a, b) for a, b in zip(tokens[kv], tokens["bfloat16"])]
        out["greedy"][kv] = {
            "identical": sum(p == args.max_tokens for p in prefix),
            "of": len(prefix),
            "mean_common_prefix": statistics.fmean(prefix),
            "first_token_agreement": sum(p > 0 for p in prefix) / len(prefix),
        }
    forced = [p + t for p, t in zip(prompt_ids, tokens["bfloat16"])]
    starts = [len(p) for p in prompt_ids]
    logprobs = {}
    for kv in CACHES:
        llm = LLM(model, kv_cache_dtype=kv, max_num_batched_tokens=args.chunk, enable_prefix_caching=False, **engine)
        logprobs[kv] = continuation_logprobs(llm, forced, starts)
        del llm
    for kv in ("auto", "fp8"):
        out["logprob_delta_vs_bfloat16"][kv] = deltas(logprobs[kv], logprobs["bfloat16"])
    log(f"{model}: blocks {out['blocks']}, greedy vs bf16 {out['greedy']}, logprob deltas "
        f"{out['logprob_delta_vs_bfloat16']}")  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,gemma-3-270m")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk for the teacher-forced pass")
    parser.add_argument("--kv-cache-memory", type=int, default=256, help="MiB")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results = [run_model(m, args) for m in args.models.split(",")]
    write_json(args.out, {**run_info(started), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
