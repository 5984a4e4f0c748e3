"""The KV cache by layer type (issue 37, acceptance 3): how many 8k-token sequences one KV cache holds at
once when sliding-window layers keep only their window (``kv_cache_interface``), against the all-global
layout (``disable_hybrid_kv_cache_manager``: every layer keeps every token, as before).

Model: random weights with Gemma 3 270M's attention and KV-cache geometry, read from the installed
``gemma-3-270m`` config where present (18 layers, 5 sliding-window layers of 512 tokens to 1 global, one
KV head of 256, float32 KV): its KV cache is the real model's byte for byte. The hidden and MLP widths
are shrunk (64 / 128) and the vocabulary is SmolLM2's, so the run measures the cache, not the matmuls.

Workload: ``--num-requests`` (20) random prompts of 8128 tokens, 64 greedy tokens each (8192 at the end),
all submitted at once, into a ``--kv-cache-memory`` (1 GiB, the CPU default) cache, prefix caching on (the
prompts share nothing; a preempted sequence gets its computed blocks back while they stay cached).
Reported per layout: KV blocks and bytes per block, the most sequences holding their whole prompt's KV
at the same step (the concurrency that counts: shorter ones are still prefilling), preemptions, the
blocks one 8k sequence needs by the layout's arithmetic, the wall time; and the ratio of the two peaks.

Run from the repository root (~6 min on 2 cores):
    .venv/bin/python bench/kv_capacity.py --out bench/results/kv_capacity.json

With ``--kv-cache-dtypes A,B`` (issue 53, acceptance 3: ``bfloat16,fp8``) it compares the two cache dtypes
instead, both by layer type, and reports B's peak over A's:
    .venv/bin/python bench/kv_capacity.py --kv-cache-dtypes bfloat16,fp8 --kv-cache-memory 268435456
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from cb_serve import LLM, SamplingParams
from cb_serve.benchmarks.report import log, run_info, write_json

PROMPT, OUTPUT = 8128, 64


def gemma3_270m_kv_config(vocab_size: int):
    """Gemma 3 270M's config (the installed GGUF's, else its published values) with narrow weights."""
    import transformers

    try:
        from cb_serve.model_executor import loader

        config = loader.load_config(loader.resolve_model_source("gemma-3-270m"), False)
        source = "gemma-3-270m (installed)"
    except (ValueError, ImportError, OSError):
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
            sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768,
        )  # fmt: skip
        source = "Gemma3TextConfig with Gemma 3 270M's published values"
    fields = config.to_dict()
    fields.update(hidden_size=64, intermediate_size=128, vocab_size=vocab_size, tie_word_embeddings=True)
    return transformers.Gemma3TextConfig(**fields), source


def make_model(directory: Path) -> str:
    from transformers import AutoModelForCausalLM

    from cb_serve.model_executor.loader import default_model_source, load_tokenizer

    tokenizer = load_tokenizer(default_model_source(), None, False)
    config, source = gemma3_270m_kv_config(len(tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return source


def run(model_dir: Path, hybrid: bool, prompts: list[list[int]], kv_bytes: int, kv_dtype: str = "auto") -> dict:
    llm = LLM(
        str(model_dir),
        max_model_len=PROMPT + OUTPUT,
        kv_cache_memory=kv_bytes,
        max_num_seqs=64,
        disable_hybrid_kv_cache_manager=not hybrid,
        kv_cache_dtype=kv_dtype,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    peak = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        full = sum(1 for s in engine.scheduler.running if s.num_computed_tokens >= PROMPT)
        peak = max(peak, full)
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    runner = engine.runner
    tensors = {c.untyped_storage().data_ptr(): c for c in runner.kv_caches}  # layers view shared tensors
    per_block = sum(t.numel() * t.element_size() for t in tensors.values())
    per_block //= stats.kv_blocks_total
    result = {
        "layout": "by layer type" if hybrid else "all-global",
        "kv_cache_dtype": kv_dtype,
        "kv_groups": [[g.sliding_window, len(g.layers)] for g in runner.kv_layout.groups],
        "kv_blocks": stats.kv_blocks_total,
        "bytes_per_block": per_block,
        "blocks_per_8k_sequence": runner.kv_layout.blocks_per_sequence(PROMPT + OUTPUT, 16),
        "peak_sequences_at_full_context": peak,
        "preemptions": stats.num_preemptions,
        "steps": steps,
        "wall_s": round(wall, 1),
    }
    log(f"{result['layout']}: {result}")
    llm.engine.shutdown()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=20)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    ap.add_argument("--kv-cache-dtypes", help="A,B: compare two cache dtypes by layer type, not the layouts")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT)] for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as tmp:
        source = make_model(Path(tmp))
        if args.kv_cache_dtypes:  # [B, A]: the ratio below is the first's peak over the second's
            dtypes = args.kv_cache_dtypes.split(",")[::-1]
            runs = [run(Path(tmp), True, prompts, args.kv_cache_memory, kv) for kv in dtypes]
        else:
            runs = [run(Path(tmp), hybrid, prompts, args.kv_cache_memory) for hybrid in (True, False)]
    ratio = runs[0]["peak_sequences_at_full_context"] / max(1, runs[1]["peak_sequences_at_full_context"])
    report = {
        "run": run_info(started),
        "config_source": source,
        "workload": {
            "requests": args.num_requests,
            "prompt": PROMPT,
            "output": OUTPUT,
            "kv_bytes": args.kv_cache_memory,
        },
        "runs": runs,
        "concurrency_ratio": round(ratio, 2),
    }
    names = dtypes if args.kv_cache_dtypes else ["by layer type", "all-global"]
    log(f"sequences at 8k at once: {runs[0]['peak_sequences_at_full_context']} {names[0]}, "
        f"{runs[1]['peak_sequences_at_full_context']} {names[1]}: {ratio:.2f}x")  # fmt: skip
    if args.out:
        write_json(args.out, report)
    return 0 if ratio >= (1.9 if args.kv_cache_dtypes else 4) else 1


if __name__ == "__main__":
    sys.exit(main())
