"""The GPU check's measurements (run by ``bench/gpu_check.sh`` after the gpu tests), on one CUDA
device, offline, with random-weight models built on the GPU from transformers configs:

1. greedy equality against HF ``generate`` on the GPU, float32 and bfloat16, a SmolLM2-shaped model
   (Triton attention, CUDA graphs), and graphs on against off (bfloat16). Tie rule: where HF's top
   two log-probabilities at a step are within ``TIE[dtype]``, the picks may differ and the
   comparison of that request stops there (float32: reduction order; bfloat16: its 8-bit mantissa);
2. a 1B Llama (Llama-3.2-1B shapes) in bfloat16, KV cache sized from device memory: start-up time,
   TTFT of a 2k-token prompt (the first request, then a warm one), decode tok/s and the fraction of
   the HBM-bandwidth bound at batch 1, 16, 64 and 256 with graphs, and at 16 and 64 without;
3. the peak memory of sampled steps (top-p at 256 rows, full prefill budget) against
   ``activation_bytes``, the KV-sizing estimate;
4. a tiny model's engine sized from device memory (millions of KV blocks): start-up time and host memory.

    python3 bench/gpu_check.py --json OUT.json       (``--quick``: fewer and shorter requests)
    python3 bench/gpu_check.py --smoke                 the script itself on the CPU, tiny models
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cb_offline import greedy, recording_steps  # noqa: E402
from gpu_bench import LLAMA_1B, TINY, kv_bytes_per_token, make_model, weight_bytes  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402

from cb_serve import LLM, SamplingParams  # noqa: E402
from cb_serve.benchmarks.report import cb_serve_source, log, write_json  # noqa: E402
from cb_serve.config import EngineConfig  # noqa: E402
from cb_serve.engine.kv_cache_sizing import activation_bytes  # noqa: E402

SMOL_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    initializer_range=0.1,  # peaked logits: few ties
)
TIE = {torch.float32: 1e-3, torch.bfloat16: 0.1}
CUDA = torch.device("cuda")  # --smoke: the CPU
SHAPES = {"smol": SMOL_SHAPE, "1b": LLAMA_1B, "tiny": TINY}


def sync() -> None:
    if CUDA.type == "cuda":
        torch.cuda.synchronize()


def first_divergence(ours: list[int], ref: list[int], ref_logprobs: torch.Tensor, tie: float) -> str:
    """``same``, ``tie`` (first differing pick where HF's top two are within ``tie``) or ``MISMATCH``."""
    for t, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = ref_logprobs[t].topk(2).values
            return "tie" if float(top2[0] - top2[1]) < tie else f"MISMATCH at {t}"
    return "same" if len(ours) == len(ref) else "MISMATCH (length)"


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int, dtype: torch.dtype) -> list[tuple[list, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(CUDA).eval()
    model.generation_config.eos_token_id = None  # as the engine's ignore_eos
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p], device=CUDA), max_new_tokens=n, do_sample=False,
                           output_scores=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
        scores = torch.stack(g.scores)[:, 0].float().log_softmax(-1).cpu()
        out.append((g.sequences[0, len(p) :].tolist(), scores))
    del model
    return out


def equality(tmp: Path, quick: bool) -> dict[str, Any]:
    model_dir = make_model(tmp / "smol", SHAPES["smol"], torch.float32, CUDA)
    gen = torch.Generator().manual_seed(1)
    lens = [5, 17, 64, 300] if quick else [5, 9, 17, 40, 64, 130, 300, 700]
    prompts = [torch.randint(2, SHAPES["smol"]["vocab_size"], (n,), generator=gen).tolist() for n in lens]
    n = 16 if quick else 32
    args = dict(device=CUDA.type, max_model_len=1024, max_num_seqs=16, num_gpu_blocks=1024)
    result: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = hf_greedy(model_dir, prompts, n, dtype)
        runs = (
            {"graphs": dict(args)}
            if dtype == torch.float32
            else {"graphs": args, "eager": {**args, "enforce_eager": True}}
        )
        tokens = {}
        for name, kwargs in runs.items():
            llm = LLM(str(model_dir), dtype=str(dtype).removeprefix("torch."), **kwargs)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            verdicts = [first_divergence(t, r, lp, TIE[dtype]) for t, (r, lp) in zip(tokens[name], ref)]
            key = f"{str(dtype).removeprefix('torch.')}_{name}_vs_hf"
            result[key] = {v: verdicts.count(v) for v in sorted(set(verdicts))}
            result[f"{key}_backend"] = llm.engine.backend.name
            del llm
            gc.collect()
        if "eager" in tokens:
            same = sum(a == b for a, b in zip(tokens["graphs"], tokens["eager"]))
            result["bfloat16_graphs_vs_eager_identical"] = f"{same}/{len(prompts)}"
    result["ok"] = all("MISMATCH" not in k for v in result.values() if isinstance(v, dict) for k in v)
    return result


def decode_at(llm: LLM, batch: int, prompt_len: int, out_len: int, bandwidth: float) -> dict[str, Any]:
    """Median decode-only step at ``batch`` rows: tok/s and the bandwidth bound's fraction."""
    gen = torch.Generator().manual_seed(batch)
    vocab = SHAPES["1b"]["vocab_size"]
    prompts = [
        {"prompt_token_ids": torch.randint(2, vocab, (prompt_len,), generator=gen).tolist()} for _ in range(batch)
    ]
    with recording_steps(llm) as steps:
        start = time.perf_counter()
        llm.generate(prompts, greedy(out_len), use_tqdm=False)
        wall = time.perf_counter() - start
    decodes = [s for s in steps if not s.num_prefill_tokens]
    rows = max(s.num_seqs for s in decodes)  # batch, unless the KV cache could not hold them all
    step_s = statistics.median(s.duration_s for s in decodes if s.num_seqs == rows)
    bound_s = (weight_bytes(llm) + kv_bytes_per_token(llm) * rows * (prompt_len + out_len / 2)) / (bandwidth * 1e9)
    return {"rows": rows, "decode_tok_s": round(rows / step_s), "step_ms": round(step_s * 1e3, 3),
            "hbm_fraction": round(bound_s / step_s, 3), "generate_tok_s": round(batch * out_len / wall)}  # fmt: skip


def ttft(llm: LLM, prompt_len: int, seed: int) -> float:
    prompt = torch.randint(2, SHAPES["1b"]["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(seed))
    sync()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt.tolist()}], greedy(1), use_tqdm=False)
    return round((time.perf_counter() - start) * 1e3, 1)


def llama_1b(tmp: Path, quick: bool) -> dict[str, Any]:
    bandwidth = copy_bandwidth(1 << 30, reps=10, device=CUDA, dtype=torch.bfloat16, warmup=2)
    model_dir = make_model(tmp / "llama1b", SHAPES["1b"], torch.bfloat16, CUDA)
    r: dict[str, Any] = {"hbm_copy_gb_s": round(bandwidth)}
    engine_args = dict(device=CUDA.type, dtype="bfloat16", max_model_len=2304, max_num_seqs=256)
    if CUDA.type == "cpu":
        engine_args["num_gpu_blocks"] = 4096
    sync()
    start = time.perf_counter()
    llm = LLM(str(model_dir), **engine_args)
    r["startup_s"] = round(time.perf_counter() - start, 1)
    r["kv_blocks"], r["backend"] = llm.engine.num_blocks, llm.engine.backend.name
    r["ttft_2k_first_ms"], r["ttft_2k_warm_ms"] = ttft(llm, 2000, 1), ttft(llm, 2000, 2)
    out_len = 32 if quick else 64
    for batch in (1, 16, 64, 256):
        r[f"graphs_batch_{batch}"] = decode_at(llm, batch, 128, out_len, bandwidth)
    r["memory"] = peak_memory(llm, engine_args)
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    eager = LLM(str(model_dir), enforce_eager=True, **{"num_gpu_blocks": 8192, **engine_args})
    for batch in (16, 64):
        r[f"eager_batch_{batch}"] = decode_at(eager, batch, 128, out_len, bandwidth)
    return r


def peak_memory(llm: LLM, engine_args: dict[str, Any]) -> dict[str, Any]:
    """A full-budget prefill and 256 rows sampled with top-p: the step's peak above what the engine
    holds between steps, against the estimate the KV cache was sized with."""
    from cb_serve.model_executor.loader import load_config

    if CUDA.type != "cuda":
        return {}
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(2, 32000, (64,), generator=gen).tolist()} for _ in range(256)]
    llm.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - held
    config = EngineConfig.from_kwargs(model=llm.engine.source.path, **engine_args)
    estimate = activation_bytes(load_config(llm.engine.source), config, 2)
    free, total = torch.cuda.mem_get_info()
    return {"step_peak_gib": round(peak / 2**30, 3), "estimate_gib": round(estimate / 2**30, 3),
            "peak_over_estimate": round(peak / estimate, 3), "device_free_gib": round(free / 2**30, 2),
            "device_total_gib": round(total / 2**30, 2)}  # fmt: skip


def many_blocks(tmp: Path) -> dict[str, Any]:
    import resource

    model_dir = make_model(tmp / "tiny", TINY, torch.bfloat16, CUDA)
    sized = {} if CUDA.type == "cuda" else {"num_gpu_blocks": 1 << 20}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    llm = LLM(str(model_dir), device=CUDA.type, dtype="bfloat16", max_model_len=256, enforce_eager=True, **sized)
    r = {"startup_s": round(time.perf_counter() - start, 1), "kv_blocks": llm.engine.num_blocks}
    r["host_max_rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) >> 10
    r["tokens"] = len(llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids)
    return r


def stage(out: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Runs one part; a failure is recorded and the next part still runs."""
    start = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - reported in the summary
        traceback.print_exc()
        out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    out[name]["seconds"] = round(time.perf_counter() - start, 1)
    log(f"[{name}] {out[name]}")
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    p.add_argument("--smoke", action="store_true", help="the script itself, on the CPU with tiny models")
    args = p.parse_args(argv)
    import transformers
    import triton

    global CUDA
    if args.smoke:
        CUDA, args.quick = torch.device("cpu"), True
        SHAPES.update(smol=dict(TINY, vocab_size=1000), **{"1b": TINY})
    name = torch.cuda.get_device_name() if CUDA.type == "cuda" else "cpu (smoke run)"
    out: dict[str, Any] = {"source": cb_serve_source(), "device_name": name,
                           "torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        stage(out, "equality", lambda: equality(Path(tmp), args.quick))
        stage(out, "llama_1b", lambda: llama_1b(Path(tmp), args.quick))
        stage(out, "many_blocks", lambda: many_blocks(Path(tmp)))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
