"""GPU benchmark: a random-weight ~1B Llama (Llama-3.2-1B shapes, 32k vocab) in bfloat16 on one CUDA device.

Prints, in one run on one card:
  1. HBM bandwidth: a device-to-device copy of 1 GiB, (read + write bytes) / median time.
  2. Decode roofline: ``--batch-size`` sequences (>= 64) decoding at ~``--prompt-len`` tokens of context.
     A decode step must read every weight once plus each sequence's KV, so its lower bound is
     (weight bytes + KV bytes) / bandwidth. Reported against (a) the engine's decode-only step time
     (scheduling, sampling and detokenization included) and (b) the CUDA-graph replay alone.
  3. End to end: cb-serve ``LLM.generate`` on ``--num-requests`` prompts of ``--prompt-len`` random tokens and
     ``--output-len`` output tokens (greedy, EOS ignored) vs HF ``model.generate`` static batching
     (``--hf-batch-size`` prompts per call, equal lengths so no padding) on the same prompts: generated tok/s.

Run from the repository root on a GPU machine:
    .venv/bin/python bench/gpu_bench.py --json bench/results/gpu_h100.json
    .venv/bin/python bench/gpu_bench.py --tensor-parallel-size 2 --json bench/results/gpu_h100_tp2.json
    .venv/bin/python bench/gpu_bench.py --tiny --device cpu    # smoke test of the script itself (no graphs)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cb_offline import greedy, recording_steps  # noqa: E402
from roofline import copy_bandwidth, sync  # noqa: E402

from cb_serve import LLM  # noqa: E402
from cb_serve.benchmarks.cpu_accounting import Timer  # noqa: E402
from cb_serve.benchmarks.report import agreement, cb_serve_source, log, write_json  # noqa: E402
from cb_serve.model_executor.cuda_graph import bucket_for  # noqa: E402

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
TINY = dict(
    LLAMA_1B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)


def make_model(directory: Path, shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Path:
    """A random-weight Llama saved as an HF model directory, with a word-level tokenizer of its vocabulary
    (the benchmark sends token ids; the tokenizer only has to exist)."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**shape, rms_norm_eps=1e-5, rope_theta=500000.0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t1", unk_token="t0").save_pretrained(directory)
    del model
    return directory


def weight_bytes(llm: LLM) -> int:
    """Bytes a decode step reads: every parameter except the embedding table (only rows are read)."""
    model = llm.engine.runner.model
    embed = model.embed_tokens.weight
    return sum(
        p.numel() * p.element_size() for p in model.parameters() if p is not embed or model.lm_head.weight is embed
    )


def kv_bytes_per_token(llm: LLM) -> int:
    cache = llm.engine.runner.kv_caches[0]  # [2, blocks, block_size, kv_heads, head_dim]
    return 2 * cache.shape[-2] * cache.shape[-1] * cache.element_size() * len(llm.engine.runner.kv_caches)


def graph_replay_ms(llm: LLM, rows: int, device: torch.device, reps: int = 50) -> float | None:
    graphs = llm.engine.runner.graph_runner
    if graphs is None or not graphs.capture:
        return None
    size = bucket_for(rows, graphs.sizes)
    if size is None:  # more rows than the largest captured size (256): those steps run eagerly
        return None
    graph = graphs.graphs[size]
    graph.replay()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    sync(device)
    return (time.perf_counter() - t0) / reps * 1e3


def run_cb_serve(llm: LLM, prompts: list[list[int]], output_len: int, device: torch.device) -> dict[str, Any]:
    llm.generate([prompts[0][:8]], greedy(4), use_tqdm=False)
    sync(device)
    with recording_steps(llm) as steps, Timer() as timer:
        outputs = llm.generate(prompts, greedy(output_len), use_tqdm=False)
        sync(device)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    full_decode = [s for s in steps if not s.num_prefill_tokens and s.num_seqs == len(prompts)]
    return {
        "wall_s": timer.wall_s,
        "generated_tokens": generated,
        "generated_tok_s": generated / timer.wall_s,
        "steps": len(steps),
        "full_batch_decode_steps": len(full_decode),
        "decode_step_ms_median": 1e3 * statistics.median(s.duration_s for s in full_decode) if full_decode else None,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }


@torch.inference_mode()
def run_hf_static(model_dir: Path, prompts: list[list[int]], output_len: int, batch_size: int, dtype, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    model.generate(torch.tensor(prompts[:1], device=device), max_new_tokens=4, do_sample=False, pad_token_id=0)
    generated, token_ids = 0, []
    sync(device)
    with Timer() as timer:
        for start in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[start : start + batch_size], device=device)
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)[:, batch.shape[1] :]
            generated += out.numel()
            token_ids += out.tolist()
        sync(device)
    del model
    return {
        "wall_s": timer.wall_s,
        "generated_tokens": generated,
        "generated_tok_s": generated / timer.wall_s,
        "token_ids": token_ids,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model (smoke test of the script)")
    p.add_argument("--batch-size", type=int, default=64, help="decoding sequences (= requests)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (the roofline is per rank)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def load_engine(model_dir: Path, dtype: torch.dtype, device: torch.device, args: argparse.Namespace) -> LLM:
    return LLM(
        str(model_dir),
        dtype=str(dtype).removeprefix("torch."),
        device=args.device,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=max(args.batch_size, 8),
        max_num_batched_tokens=max(2048, args.batch_size),
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        num_gpu_blocks=None if device.type == "cuda" else 2048,
    )


def decode_roofline(
    llm: LLM, cb: dict[str, Any], bandwidth: float, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """The decode step's bandwidth bound against the engine's median full-batch decode step (printed)."""
    weights = weight_bytes(llm)
    mean_context = args.prompt_len + args.output_len / 2
    kv = kv_bytes_per_token(llm) * mean_context * args.batch_size
    roofline_ms = (weights + kv) / (bandwidth * 1e9) * 1e3
    replay_ms = graph_replay_ms(llm, args.batch_size, device)
    engine_ms = cb["decode_step_ms_median"]
    log(
        f"decode step, {args.batch_size} rows at ~{mean_context:.0f} tokens of context: roofline "
        f"{roofline_ms:.2f} ms ({weights / 1e9:.2f} GB weights + {kv / 1e9:.2f} GB KV), engine step "
        f"{engine_ms} ms, graph replay {replay_ms} ms"
    )
    return {
        "weight_bytes": weights,
        "kv_bytes_at_mean_context": kv,
        "roofline_step_ms": roofline_ms,
        "engine_step_ms": engine_ms,
        "graph_replay_ms": replay_ms,  # at the final cache content: KV of every row ends near full context
        "engine_fraction_of_roofline": roofline_ms / engine_ms if engine_ms else None,
    }


def compare_hf(out: dict[str, Any], cb: dict[str, Any], hf: dict[str, Any], batch_size: int) -> None:
    """Adds HF static's results, cb-serve's speedup and their greedy agreement to ``out`` (printed)."""
    out["hf_static"] = {k: v for k, v in hf.items() if k != "token_ids"}
    out["speedup_vs_hf_static"] = cb["generated_tok_s"] / hf["generated_tok_s"]
    out["greedy_agreement_vs_hf"] = agreement(cb["token_ids"], hf["token_ids"])["identical_requests"]
    log(
        f"HF static (batch {batch_size}): {hf['generated_tok_s']:.1f} generated tok/s; cb-serve is "
        f"{out['speedup_vs_hf_static']:.2f}x; identical outputs {out['greedy_agreement_vs_hf']:.0%}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else LLAMA_1B
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, shape["vocab_size"], (args.batch_size, args.prompt_len), generator=gen).tolist()
    out: dict[str, Any] = {"source": cb_serve_source(), "args": vars(args), "torch": torch.__version__}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), shape, dtype, device)
        bandwidth = copy_bandwidth(1 << 30, reps=10, device=device, dtype=torch.bfloat16, warmup=2)
        out["hbm_copy_gb_s"] = bandwidth
        log(f"device {out.get('device_name', device)}: copy bandwidth {bandwidth:.0f} GB/s")
        llm = load_engine(model_dir, dtype, device, args)
        out["backend"] = llm.engine.backend.name
        out["cuda_graphs"] = llm.engine.runner.graph_runner is not None
        cb = run_cb_serve(llm, prompts, args.output_len, device)
        out["decode"] = decode_roofline(llm, cb, bandwidth, device, args)
        out["cb_serve"] = {k: v for k, v in cb.items() if k != "token_ids"}
        log(f"cb-serve: {cb['generated_tok_s']:.1f} generated tok/s ({cb['wall_s']:.2f} s)")
        llm.engine.shutdown()
        del llm
        gc.collect()  # the engine's memory goes back before HF loads (issue 24, bug 6)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not args.skip_hf:
            hf = run_hf_static(model_dir, prompts, args.output_len, args.hf_batch_size, dtype, device)
            compare_hf(out, cb, hf, args.hf_batch_size)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
