"""Hybrid-model benchmark (issue 40): a random-weight Qwen3.5-shaped model (three Gated DeltaNet layers to one
attention layer) at a long context, cb-serve against HF transformers.

1. **Model.** Qwen3.5's proportions scaled to 2 cores (each settable below): 8 layers ``L L L F`` x 2, hidden
   1024, attention 8 query / 2 KV heads of 256 with the output gate and partial RoPE (0.25), Gated DeltaNet 4
   key / 8 value heads of 128, conv kernel 4, MLP 3072, untied LM head, the built-in tokenizer; random weights
   (normal, ``--init-std``) saved in bf16 as Qwen3.5 ships, computed in float32 by both systems. Beside it, the
   **all-attention model of the same shape** (every layer ``full_attention``) for the memory comparison.
2. **Memory per sequence** at ``--context`` tokens, both as cb-serve allocates it (KV blocks of the attention
   layers + one state slot: the engine's own cache tensors per block and per slot) and as HF's cache holds it
   after a prefill (the bytes of every tensor in its ``past_key_values``), for both models.
3. **Decode throughput.** ``--batch`` sequences of ``--context`` random tokens, then ``--new-tokens`` greedy
   tokens each: cb-serve's engine stepped until every sequence has its first token (prefill), then timed to
   the end; HF: one batched forward with its cache (prefill, no padding: equal lengths), then a greedy loop of
   one-token forwards on that cache, timed. Tokens/s of the decode phase; the greedy tokens compared.
4. **A conversation's next turn** (issue 55): a ``--history``-token first turn, ``--turn-tokens`` generated, then
   the next turn (the history, the answer and ``--turn-prompt`` new tokens): its time to first token with prefix
   caching (the engine resumes from the recurrent states it kept at the last full block,
   ``engine/state_snapshots.py``) and without (the whole conversation prefilled again), the same greedy tokens.
5. **Speculative decoding at one stream** (issue 55): a prompt of a ``--spec-passage``-token random passage said
   twice and begun a third time (an input-grounded workload: an edit of pasted text), ``--spec-tokens`` greedy
   tokens, with n-gram drafts (``--spec-k``, adaptive) and without; the inter-token latency of the decode phase,
   the drafts' acceptance rate, the same greedy tokens. A random-weight model does not repeat its input, so its
   n-gram drafts are rejected (the policy then stops drafting); the verify path's gain at a given acceptance is
   measured by replaying the greedy continuation as drafts, each right with probability ``--spec-replay``
   (fixed ``k``): the rate a real model's n-gram or MTP drafts reach on input-grounded text. Then the same on a
   model that has learned something: a tiny Qwen3.5 with one MTP layer, trained here on the standard library's
   sources (``bench/trained_hybrid.py``, ~15 min once, cached), prompted with ``--spec-prompt`` tokens of a file
   it never saw: n-gram drafts (``--spec-k``) and its own MTP drafts (k = 1 .. ``--spec-mtp-k``) at a fixed k,
   as vLLM runs them, and n-gram under the adaptive policy.
6. **Against the physical limit:** a decode step reads the weights (as each ``Linear`` streams them), every
   sequence's KV over its context, and reads and writes its recurrent state; the DRAM read bandwidth
   (``bandwidth.read_bandwidth``) over those bytes is the step's floor.

Run from the repository root:
    .venv/bin/python bench/hybrid_bench.py --json bench/results/hybrid.json     # ~10 min on 2 cores
    .venv/bin/python bench/hybrid_bench.py --context 512 --new-tokens 8 --num-layers 4   # smoke test
    .venv/bin/python bench/hybrid_bench.py --turns-only --json bench/results/hybrid_turns.json   # item 4 alone
    .venv/bin/python bench/hybrid_bench.py --spec-only --json bench/results/hybrid_spec.json     # item 5 alone
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cb_serve import LLM, SamplingParams
from cb_serve.benchmarks.bandwidth import read_bandwidth, weight_bytes
from cb_serve.benchmarks.llama_cpp import CACHE_ROOT
from cb_serve.benchmarks.report import log, write_json
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.model_executor import loader
from cb_serve.spec_decode.proposer import DraftProposer

CACHE_DIR = CACHE_ROOT.parent / "hybrid_bench"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = parser.add_argument_group("model shape (Qwen3.5)")
    shape.add_argument("--hidden-size", type=int, default=1024)
    shape.add_argument("--num-layers", type=int, default=8)
    shape.add_argument("--full-attention-interval", type=int, default=4)
    shape.add_argument("--num-heads", type=int, default=8)
    shape.add_argument("--num-kv-heads", type=int, default=2)
    shape.add_argument("--head-dim", type=int, default=256)
    shape.add_argument("--linear-key-heads", type=int, default=4)
    shape.add_argument("--linear-value-heads", type=int, default=8)
    shape.add_argument("--linear-head-dim", type=int, default=128)
    shape.add_argument("--intermediate-size", type=int, default=3072)
    shape.add_argument("--init-std", type=float, default=0.02)
    shape.add_argument("--model-seed", type=int, default=0)
    run = parser.add_argument_group("run")
    run.add_argument("--context", type=int, default=8192, help="Prompt tokens per sequence.")
    run.add_argument("--batch", type=int, default=4, help="Sequences decoded together.")
    run.add_argument("--new-tokens", type=int, default=64)
    run.add_argument("--max-num-batched-tokens", type=int, default=2048)
    run.add_argument("--history", type=int, default=4096, help="The first turn's prompt tokens (item 4).")
    run.add_argument("--turn-tokens", type=int, default=32, help="Tokens the first turn generates.")
    run.add_argument("--turn-prompt", type=int, default=64, help="New prompt tokens of the next turn.")
    run.add_argument("--turns-only", action="store_true", help="Run item 4 alone.")
    run.add_argument("--spec-passage", type=int, default=200, help="The passage's tokens (item 5).")
    run.add_argument("--spec-tokens", type=int, default=128, help="Tokens generated (item 5).")
    run.add_argument("--spec-k", type=int, default=4, help="num_speculative_tokens (item 5).")
    run.add_argument(
        "--spec-replay",
        type=float,
        nargs="*",
        default=[0.8, 1.0],
        help="Item 5: also replay the greedy continuation as drafts, each right with these probabilities.",
    )
    run.add_argument("--spec-prompt", type=int, default=256, help="Held-out prompt tokens for the trained model.")
    run.add_argument("--spec-mtp-k", type=int, default=2, help="MTP drafts per step on the trained model.")
    run.add_argument("--spec-only", action="store_true", help="Run item 5 alone.")
    run.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    run.add_argument("--json", help="Write the results here.")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace, tokenizer, all_attention: bool) -> dict[str, Any]:
    interval = args.full_attention_interval
    full = [all_attention or (i + 1) % interval == 0 for i in range(args.num_layers)]
    return {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "layer_types": ["full_attention" if f else "linear_attention" for f in full],
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_key_head_dim": args.linear_head_dim,
        "linear_value_head_dim": args.linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "intermediate_size": args.intermediate_size,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": args.context + args.new_tokens + 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6,
        "initializer_range": args.init_std,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def build_model(args: argparse.Namespace, all_attention: bool) -> Path:
    """The HF directory of the shape (cached): random weights in bf16, the built-in tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    tokenizer = loader.load_tokenizer(loader.default_model_source())
    config = model_config(args, tokenizer, all_attention)
    key = hashlib.sha256(json.dumps([config, args.model_seed], sort_keys=True).encode()).hexdigest()[:12]
    directory = args.cache_dir / key / "hf"
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(args.model_seed)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**config), dtype=torch.float32)
    tmp = directory.with_name("hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(directory)
    return directory


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        max_model_len=args.context + args.new_tokens + 16,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype="float32",
    )


def cb_serve_memory(llm: LLM, context: int) -> dict[str, Any]:
    """The bytes cb-serve holds for one sequence of ``context`` tokens: its KV blocks (per block, all KV-cache
    tensors) and its state slot (per slot, every recurrent layer's state tensors)."""
    runner = llm.engine.runner
    blocks = runner.kv_layout.blocks_per_sequence(context, runner.block_size, 1)
    kv = {id(t): t for i, t in enumerate(runner.kv_caches) if i not in runner.kv_layout.state_layers and t is not None}
    per_block = sum(t.nbytes for t in kv.values()) // llm.engine.num_blocks
    states = runner.state_cache.layers.values() if runner.state_cache else ()
    per_slot = sum(c.nbytes + s.nbytes for c, s in states) // (runner.state_cache.num_slots if states else 1)
    return {"kv_bytes": blocks * per_block, "state_bytes": per_slot, "total_bytes": blocks * per_block + per_slot}


def hf_memory(model, context: int) -> int:
    """The bytes of HF's cache after a ``context``-token prefill of one sequence: every tensor it holds
    (attention layers' keys and values, linear-attention layers' conv and recurrent states)."""
    ids = torch.randint(100, 4000, (1, context))
    with torch.inference_mode():
        cache = model(ids, use_cache=True).cache
    seen: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            seen[id(value)] = value.nbytes
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.device, torch.dtype)):
            walk(vars(value))

    walk(cache.layers)
    return sum(seen.values())


def run_cb_serve(model_dir: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    llm = LLM(str(model_dir), **engine_args(args))
    try:
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        llm.generate([p[:64] for p in prompts], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
        engine, outputs = llm.engine, {}
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        first: dict[str, int] = {}
        while len(first) < len(prompts):
            for out in engine.step():
                first.setdefault(out.request_id, len(out.outputs[0].token_ids))
        prefill_s = time.perf_counter() - start
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
        decode_s = time.perf_counter() - start - prefill_s
        decoded = sum(len(t) for t in outputs.values()) - sum(first.values())
        return {
            "prefill_s": prefill_s,
            "prefill_tok_s": len(prompts) * args.context / prefill_s,
            "decode_s": decode_s,
            "decode_tokens": decoded,
            "decode_tok_s": decoded / decode_s,
            "tokens": [outputs[str(i)] for i in range(len(prompts))],
            "memory": cb_serve_memory(llm, args.context),
            "step_bytes": decode_step_bytes(llm, args),
        }
    finally:
        llm.engine.shutdown()


def decode_step_bytes(llm: LLM, args: argparse.Namespace) -> int:
    """Bytes one decode step of the batch reads at the full context: weights, KV, states (read and written)."""
    memory = cb_serve_memory(llm, args.context)
    weights = weight_bytes(llm.engine.runner.model, args.batch, args.batch)
    return weights + args.batch * (memory["kv_bytes"] + 2 * memory["state_bytes"])


def run_hf(model_dir: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model(ids[:, :64])  # warm
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill_s = time.perf_counter() - start
        cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        start = time.perf_counter()
        for _ in range(args.new_tokens - 1):
            out = model(token, cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        decode_s = time.perf_counter() - start
    decoded = len(prompts) * (args.new_tokens - 1)
    return {
        "prefill_s": prefill_s,
        "prefill_tok_s": len(prompts) * args.context / prefill_s,
        "decode_s": decode_s,
        "decode_tokens": decoded,
        "decode_tok_s": decoded / decode_s,
        "tokens": torch.cat(tokens, dim=1).tolist(),
        "memory_bytes": hf_memory(model, args.context),
    }


def next_turn_ttft(model_dir: Path, args: argparse.Namespace, caching: bool) -> dict[str, Any]:
    """Item 4: the next turn's time to first token after a ``--history``-token first turn (prefix caching on
    or off), and its greedy tokens."""
    gen = torch.Generator().manual_seed(2)
    history = torch.randint(100, 40000, (args.history,), generator=gen).tolist()
    extra = torch.randint(100, 40000, (args.turn_prompt,), generator=gen).tolist()
    llm = LLM(str(model_dir), **dict(engine_args(args), max_model_len=len(history) + 2 * 256 + 16, max_num_seqs=2),
              enable_prefix_caching=caching)  # fmt: skip
    try:
        llm.generate([history[:64]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm
        params = SamplingParams(temperature=0, max_tokens=args.turn_tokens, ignore_eos=True)
        (first,) = llm.generate([history], params, use_tqdm=False)
        turn = history + list(first.outputs[0].token_ids) + extra
        engine, start = llm.engine, time.perf_counter()
        engine.add_request("turn", turn, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        ttft, tokens, cached = None, [], 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - start
                tokens, cached = list(out.outputs[0].token_ids), out.num_cached_tokens or cached
        return {"ttft_s": ttft, "prompt_tokens": len(turn), "cached_tokens": cached, "tokens": tokens}
    finally:
        llm.engine.shutdown()


def next_turn(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    cached, uncached = next_turn_ttft(model_dir, args, True), next_turn_ttft(model_dir, args, False)
    result = {
        "history": args.history,
        "with_prefix_caching": {k: v for k, v in cached.items() if k != "tokens"},
        "without": {k: v for k, v in uncached.items() if k != "tokens"},
        "ttft_speedup": uncached["ttft_s"] / cached["ttft_s"],
        "same_tokens": cached["tokens"] == uncached["tokens"],
    }
    log(f"next turn after {args.history} tokens: TTFT {cached['ttft_s'] * 1e3:.0f} ms cached "
        f"({cached['cached_tokens']} tokens resumed), {uncached['ttft_s'] * 1e3:.0f} ms without: "
        f"{result['ttft_speedup']:.1f}x")  # fmt: skip
    return result


class ReplayProposer(DraftProposer):
    """Drafts a known greedy continuation, each draft right with probability ``p`` (seeded): verify steps at a
    set acceptance rate, for a random-weight model that never repeats its input (n-gram drafts find nothing)."""

    def __init__(self, prompt: list[int], continuation: list[int], p: float) -> None:
        self.prompt, self.continuation, self.p = prompt, continuation, p
        self.rng = random.Random(0)

    def propose(self, seqs, num_drafts):
        drafts = []
        for seq, k in zip(seqs, num_drafts):
            future = self.continuation[seq.num_output_tokens :][:k] if seq.prompt_token_ids == self.prompt else []
            drafts.append([t if self.rng.random() < self.p else t + 1 for t in future])
        return drafts


def one_stream(
    model_dir: Path, args: argparse.Namespace, prompt: list[int], spec: dict | None, replay: DraftProposer | None = None
) -> dict[str, Any]:
    """Item 5: one greedy stream's decode-phase inter-token latency, with ``spec`` drafts (``replay``'s) or none."""
    llm = LLM(str(model_dir), **dict(engine_args(args), max_model_len=len(prompt) + args.spec_tokens + 16,
              max_num_seqs=1), speculative_config=spec)  # fmt: skip
    if replay is not None:
        llm.engine.speculator.proposer = replay  # the engine's own proposer swapped (not a public interface)
    try:
        llm.generate([prompt[:32]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
        engine = llm.engine
        engine.add_request("one", prompt, SamplingParams(temperature=0, max_tokens=args.spec_tokens, ignore_eos=True))
        first = tokens = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
                if first is None and tokens:
                    first = (time.perf_counter(), len(tokens))
        assert first is not None and tokens is not None
        itl = (time.perf_counter() - first[0]) / (len(tokens) - first[1])
        counters = getattr(engine.speculator, "counters", None)
        drafted = counters.num_draft_tokens if counters else 0
        accepted = counters.num_accepted_tokens if counters else 0
        return {"itl_ms": itl * 1e3, "drafted": drafted, "accepted": accepted, "tokens": tokens}
    finally:
        llm.engine.shutdown()


def speculation(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    passage = torch.randint(100, 40000, (args.spec_passage,), generator=gen).tolist()
    prompt = passage + passage + passage[: args.spec_passage // 4]
    spec = {"method": "ngram", "num_speculative_tokens": args.spec_k, "prompt_lookup_max": 4}
    plain = one_stream(model_dir, args, prompt, None)
    runs = {"ngram": one_stream(model_dir, args, prompt, spec)}
    for p in args.spec_replay:
        replay = ReplayProposer(prompt, plain["tokens"], p)
        runs[f"replay_p{p}"] = one_stream(model_dir, args, prompt, {**spec, "adaptive": False}, replay)
    result = {"prompt_tokens": len(prompt), "k": args.spec_k, **_against(plain, runs, "random model")}
    result["trained"] = trained_speculation(args)
    return result


def trained_speculation(args: argparse.Namespace) -> dict[str, Any]:
    """Item 5 on a tiny Qwen3.5 with its MTP layer, trained here (``bench/trained_hybrid.py``): a held-out source
    file's tokens as the prompt; without drafts, with n-gram drafts and with the checkpoint's MTP drafts at a fixed
    ``k`` (vLLM's way), and n-gram under the adaptive policy (the default)."""
    from trained_hybrid import held_out_prompt, trained_hybrid

    tokenizer = loader.load_tokenizer(loader.default_model_source())
    model_dir = trained_hybrid(args.cache_dir, tokenizer)
    prompt = held_out_prompt(tokenizer, args.spec_prompt)
    ngram = {"method": "ngram", "num_speculative_tokens": args.spec_k, "prompt_lookup_max": 4, "adaptive": False}
    plain = one_stream(model_dir, args, prompt, None)
    runs = {"ngram": one_stream(model_dir, args, prompt, ngram)}
    for k in range(1, args.spec_mtp_k + 1):
        runs[f"mtp_k{k}"] = one_stream(model_dir, args, prompt, {"method": "mtp", "num_speculative_tokens": k,
                                                                 "adaptive": False})  # fmt: skip
    runs["ngram_adaptive"] = one_stream(model_dir, args, prompt, {**ngram, "adaptive": True})
    training = json.loads((model_dir / "training.json").read_text())
    result = {"model": str(model_dir), "training": training, "prompt_tokens": len(prompt)}
    return {**result, "mtp_k": args.spec_mtp_k, "ngram_k": args.spec_k, **_against(plain, runs, "trained model")}


def _against(plain: dict[str, Any], runs: dict[str, dict[str, Any]], what: str) -> dict[str, Any]:
    """Each run's ITL and acceptance against ``plain`` (no drafts), and whether its tokens are the same."""
    result: dict[str, Any] = {"without": _drop_tokens(plain)}
    for name, run in runs.items():
        rate = run["accepted"] / max(1, run["drafted"])
        result[name] = {**_drop_tokens(run), "acceptance_rate": rate, "itl_speedup": plain["itl_ms"] / run["itl_ms"],
                        "same_tokens": run["tokens"] == plain["tokens"]}  # fmt: skip
        log(f"one stream ({what}), {name}: ITL {plain['itl_ms']:.1f} ms without drafts, {run['itl_ms']:.1f} ms with "
            f"({rate:.0%} of {run['drafted']} drafts accepted): {plain['itl_ms'] / run['itl_ms']:.2f}x, "
            f"same tokens: {run['tokens'] == plain['tokens']}")  # fmt: skip
    return result


def _drop_tokens(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "tokens"}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hybrid = build_model(args, all_attention=False)
    if args.turns_only or args.spec_only:
        result = {"cpu": cpu_model_and_flags()[0], "threads": torch.get_num_threads()}
        if args.turns_only:
            result["next_turn"] = next_turn(hybrid, args)
        if args.spec_only:
            result["speculation"] = speculation(hybrid, args)
        write_json(args.json, result)
        return result
    dense = build_model(args, all_attention=True)
    log(f"models: {hybrid}, {dense}")
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, 40000, (args.batch, args.context), generator=gen).tolist()
    ours = run_cb_serve(hybrid, args, prompts)
    log(f"cb-serve: prefill {ours['prefill_tok_s']:.0f} tok/s, decode {ours['decode_tok_s']:.2f} tok/s")
    hf = run_hf(hybrid, args, prompts)
    log(f"HF: prefill {hf['prefill_tok_s']:.0f} tok/s, decode {hf['decode_tok_s']:.2f} tok/s")
    dense_llm = LLM(str(dense), **engine_args(args))
    dense_memory = cb_serve_memory(dense_llm, args.context)
    dense_llm.engine.shutdown()
    from transformers import AutoModelForCausalLM

    dense_hf = hf_memory(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval(), args.context)
    bandwidth = read_bandwidth()
    floor_s = ours["step_bytes"] / (bandwidth["gb_s"] * 1e9)
    same = sum(a == b[: len(a)] for a, b in zip(ours["tokens"], hf["tokens"]))
    result = {
        "cpu": cpu_model_and_flags()[0],
        "threads": torch.get_num_threads(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "memory_per_sequence": {
            "context": args.context,
            "cb_serve_hybrid": ours["memory"],
            "cb_serve_all_attention": dense_memory,
            "hf_hybrid_bytes": hf["memory_bytes"],
            "hf_all_attention_bytes": dense_hf,
            "all_attention_over_hybrid": dense_memory["total_bytes"] / ours["memory"]["total_bytes"],
        },
        "cb_serve": {k: v for k, v in ours.items() if k not in ("tokens", "memory")},
        "hf": {k: v for k, v in hf.items() if k != "tokens"},
        "decode_ratio_vs_hf": ours["decode_tok_s"] / hf["decode_tok_s"],
        "prefill_ratio_vs_hf": ours["prefill_tok_s"] / hf["prefill_tok_s"],
        "greedy_sequences_equal_to_hf": f"{same}/{len(prompts)}",
        "read_bandwidth_gb_s": bandwidth["gb_s"],
        "decode_floor_tok_s": args.batch / floor_s,
        "decode_fraction_of_floor": ours["decode_tok_s"] / (args.batch / floor_s),
        "next_turn": next_turn(hybrid, args),
        "speculation": speculation(hybrid, args),
    }
    log(json.dumps(result, indent=2))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
