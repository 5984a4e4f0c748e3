"""Mixture-of-experts offline benchmark (issue 39): a random-weight Qwen3-MoE-shaped model on the 64-request
workload of ``bench/throughput.py``, cb-serve against HF static batching and llama.cpp's ``llama-server``.

1. **Model.** Qwen3-30B-A3B's proportions scaled down to fit 2 cores and a few GiB (each dimension settable
   below): 16 query / 4 KV heads of 64, 64 experts, top-8 renormalized (``norm_topk_prob``, which
   llama.cpp's qwen3moe graph assumes), an expert width of a quarter of the hidden size, every layer sparse,
   untied LM head; random weights (normal, ``--init-std``; norms 1; at transformers' default 0.02 a model
   this wide repeats a few tokens greedily, hence 0.1) saved in bf16 as the real checkpoints ship
   (``--weights float32``: full float32 values), and the built-in SmolLM2 tokenizer. Every system computes
   in float32 on the weights as loaded (a bf16 checkpoint upcast exactly). Saved as a HF directory
   (safetensors) under ``--cache-dir/<hash of the shape>/hf``, with a short HF greedy sample recorded
   (``sample.json``) to show the outputs are not degenerate repeats.
2. **GGUF.** The same weights as a GGUF (``--gguf-type``: F32 by default, lossless for either weight
   dtype; BF16 is lossless for bf16 weights too, and llama.cpp then also rounds activations to bf16),
   written by ``convert_hf_to_gguf.py`` of the llama.cpp source the cached ``llama-server`` was built from
   (``llama_cpp.ensure_llama_server``), with that source's vendored ``gguf-py`` on ``PYTHONPATH``.
3. **Run.** ``throughput.main`` with cb-serve and hf-static on the HF directory and llama.cpp on the GGUF
   (``--llama-gguf``); its roofline counts the top-k experts' FLOPs per token, and its decode bound the
   weights of the experts each decode step's tokens hit (``bandwidth.py``, from the engine's per-step
   expert load). Further arguments go to ``throughput.py`` unchanged.

Run from the repository root:
    .venv/bin/python bench/moe_bench.py --json bench/results/moe.json   # ~13 min on 2 cores (+ ~1.5 min: model)
    .venv/bin/python bench/moe_bench.py --hidden-size 256 --num-layers 2 --num-requests 4   # smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import throughput
import torch

from cb_serve.benchmarks.llama_cpp import CACHE_ROOT, ensure_llama_server, vendored_source
from cb_serve.benchmarks.model_shapes import model_gemm_shapes, moe_layout
from cb_serve.benchmarks.report import log, write_json
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.model_executor import loader

CACHE_DIR = CACHE_ROOT.parent / "moe_bench"
SAMPLE_PROMPTS = ("The quick brown fox", "def fibonacci(n):", "In 1905, Albert Einstein", "Dear Sir or Madam,")
SAMPLE_TOKENS = 32


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = parser.add_argument_group("model shape (Qwen3-MoE)")
    shape.add_argument("--hidden-size", type=int, default=1024)
    shape.add_argument("--num-layers", type=int, default=12)
    shape.add_argument("--num-heads", type=int, default=16, help="Query heads.")
    shape.add_argument("--num-kv-heads", type=int, default=4)
    shape.add_argument("--head-dim", type=int, default=64)
    shape.add_argument("--num-experts", type=int, default=64)
    shape.add_argument("--top-k", type=int, default=8, help="Experts per token.")
    shape.add_argument("--expert-size", type=int, default=256, help="Each expert's intermediate size.")
    shape.add_argument("--init-std", type=float, default=0.1, help="Std of the random weights.")
    shape.add_argument("--model-seed", type=int, default=0)
    shape.add_argument("--weights", choices=("bfloat16", "float32"), default="bfloat16", help="Checkpoint dtype.")
    parser.add_argument("--gguf-type", choices=("f32", "bf16"), default="f32", help="llama.cpp's GGUF type.")
    parser.add_argument(
        "--cache-dir", type=Path, default=CACHE_DIR, help=f"Models are kept here (default: {CACHE_DIR})."
    )
    parser.add_argument(
        "--systems", default="cb-serve,hf-static,llama.cpp", help="As throughput.py's (default: all three)."
    )
    parser.add_argument("--json", metavar="OUT", help="Write throughput.py's results plus the model's here.")
    return parser.parse_known_args(argv)


def model_config(args: argparse.Namespace, tokenizer) -> dict[str, Any]:
    """The HF config (``Qwen3MoeConfig`` keyword arguments) of the benchmark's shape."""
    return {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_size,
        "intermediate_size": 4 * args.hidden_size,  # the dense MLP's, unused: every layer is sparse
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "rms_norm_eps": 1e-6,
        "initializer_range": args.init_std,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def parameter_counts(config) -> tuple[int, int]:
    """(all matmul and embedding parameters, those one token's forward multiplies: attention, routers, its
    top-k experts, LM head; norms left out)."""
    shapes, moe = model_gemm_shapes(config), moe_layout(config)
    active = sum(s.k * s.n * s.count_per_token for s in shapes)
    experts = sum(s.k * s.n * s.count_per_token for s in shapes if s.name.startswith("expert_"))
    every_expert = experts * moe.num_experts // moe.top_k
    return active - experts + every_expert + config.vocab_size * config.hidden_size, active


def sample_outputs(model, tokenizer) -> dict[str, Any]:
    """HF greedy continuations of a few short prompts: their text and share of distinct tokens."""
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=SAMPLE_TOKENS, do_sample=False, eos_token_id=None)[0, ids.shape[1] :]
        tokens = out.tolist()
        samples.append({"prompt": prompt, "text": tokenizer.decode(tokens), "distinct": len(set(tokens)) / len(tokens)})
    return {"samples": samples, "mean_distinct_share": sum(s["distinct"] for s in samples) / len(samples)}


def build_model(args: argparse.Namespace, directory: Path) -> Path:
    """The HF directory of the shape (cached): random weights, the built-in tokenizer, a greedy sample."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hf_dir = directory / "hf"
    if (hf_dir / "sample.json").is_file():
        return hf_dir
    tokenizer = loader.load_tokenizer(loader.default_model_source())
    config = Qwen3MoeConfig(**model_config(args, tokenizer))
    start = time.perf_counter()
    torch.manual_seed(args.model_seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    tmp = directory / "hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(getattr(torch, args.weights)).save_pretrained(tmp)
    model.float()  # the sample in float32, as every system runs
    tokenizer.save_pretrained(tmp)
    with torch.inference_mode():
        sample = sample_outputs(model, tokenizer)
    (tmp / "sample.json").write_text(json.dumps({**sample, "build_s": time.perf_counter() - start}, indent=2))
    del model
    tmp.rename(hf_dir)
    log(f"built {hf_dir} in {time.perf_counter() - start:.1f} s")
    return hf_dir


def convert_to_gguf(hf_dir: Path, directory: Path, outtype: str) -> tuple[Path, dict[str, Any]]:
    """The ``outtype`` GGUF of ``hf_dir`` (cached) by the cached llama.cpp build's own ``convert_hf_to_gguf.py``."""
    build = ensure_llama_server()
    source = vendored_source(build)
    gguf = directory / f"model-{outtype}.gguf"
    info = {"converter": str(source / "convert_hf_to_gguf.py"), "llama_cpp_commit": build.llama_cpp_commit}
    if gguf.is_file():
        return gguf, {**info, "reused": True}
    tmp = gguf.with_suffix(".tmp")
    command = [sys.executable, info["converter"], str(hf_dir), "--outfile", str(tmp), "--outtype", outtype]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(source / "gguf-py"), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    (directory / "convert.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed ({done.returncode}); see {directory / 'convert.log'}")
    tmp.rename(gguf)
    log(f"converted to {gguf} in {time.perf_counter() - start:.1f} s")
    return gguf, {**info, "convert_s": time.perf_counter() - start, "reused": False}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args, rest = parse_args(argv)
    tokenizer = loader.load_tokenizer(loader.default_model_source())
    config = model_config(args, tokenizer)
    key = [config, args.model_seed] + ([args.weights] if args.weights != "float32" else [])
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    directory = args.cache_dir / f"qwen3moe-{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    from transformers import Qwen3MoeConfig

    total, active = parameter_counts(Qwen3MoeConfig(**config))
    log(f"MoE model {directory.name}: {total / 1e6:.1f} M parameters, {active / 1e6:.1f} M active per token")
    hf_dir = build_model(args, directory)
    sample = json.loads((hf_dir / "sample.json").read_text())
    for s in sample["samples"]:
        log(f"    HF greedy sample ({s['distinct']:.0%} distinct): {s['prompt']!r} -> {s['text']!r}")
    gguf_info: dict[str, Any] = {}
    llama_args: list[str] = []
    if "llama.cpp" in args.systems.split(","):
        gguf, gguf_info = convert_to_gguf(hf_dir, directory, args.gguf_type)
        llama_args = ["--llama-gguf", str(gguf)]
    out = throughput.main(["--model", str(hf_dir), "--systems", args.systems, *llama_args, *rest])
    out["moe_model"] = {
        "directory": str(hf_dir),
        "config": config,
        "seed": args.model_seed,
        "weights": args.weights,
        "parameters": total,
        "active_parameters_per_token": active,
        "sample": sample,
        "gguf": gguf_info,
    }
    cpu, flags = cpu_model_and_flags()
    out["cpu"] = {"model": cpu, "flags": sorted(f for f in flags if f.startswith(("avx512", "amx")))}
    out["command"] = " ".join(sys.argv)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
