"""Multi-LoRA throughput: 64 requests spread over 8 adapters against the same 64 requests on the
base model, in one process on one machine, on SmolLM2-135M-Instruct (the offline workload of
bench/throughput.py: real-text prompts of 32-512 tokens, 16-256 output tokens, greedy, EOS
ignored). Adapters: made with PEFT at rank 16 on all seven projections of every layer. Modes,
interleaved over ``--repeats``: the base model on an engine without LoRA, the base model on the
LoRA engine, and the adapters (request i on adapter i mod 8) on the LoRA engine.

    .venv/bin/python bench/lora_bench.py --out bench/results/lora_bench.json    # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cb_serve import LLM, LoRARequest, SamplingParams
from cb_serve.benchmarks.cpu_accounting import Timer
from cb_serve.benchmarks.report import log, run_info, write_json
from cb_serve.benchmarks.workload import make_workload
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.model_executor.loader import default_model_source

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = dict(block_size=16, max_num_batched_tokens=2048, max_num_seqs=256)


def make_adapters(directory: Path, count: int, rank: int) -> list[LoRARequest]:
    """``count`` PEFT adapters of the built-in model, random A and small random B (seeded)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    src = default_model_source()
    requests = []
    for i in range(count):
        path = directory / f"adapter-{i}"
        if not (path / "adapter_config.json").exists():
            base = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
            torch.manual_seed(i)
            config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights="gaussian")
            model = get_peft_model(base, config)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.01)
            model.save_pretrained(path)
        requests.append(LoRARequest(f"adapter-{i}", i + 1, str(path)))
    return requests


def timed_run(llm: LLM, prompts, params, loras) -> tuple[float, list[list[int]]]:
    llm.engine.block_manager.reset_prefix_cache()  # every run computes every prompt
    with Timer() as timer:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return timer.wall_s, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--adapters-dir", default=None, help="where the adapters are made (default: a temp dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    model, flags = cpu_model_and_flags()
    directory = Path(args.adapters_dir or tempfile.mkdtemp(prefix="cb-serve-lora-"))
    directory.mkdir(parents=True, exist_ok=True)
    adapters = make_adapters(directory, args.adapters, args.rank)
    plain = LLM(**ENGINE)
    lora = LLM(**ENGINE, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    workload = make_workload(plain.get_tokenizer(), args.requests, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    per_request = [adapters[i % len(adapters)] for i in range(args.requests)]
    modes = {
        "base, LoRA off": (plain, None),
        "base, LoRA on": (lora, None),
        f"{args.adapters} adapters": (lora, per_request),
    }
    for llm, loras in modes.values():  # warm-up: kernels built, adapters read
        llm.generate(workload.prompts[:2], params[:2], use_tqdm=False, lora_request=loras and loras[:2])
    log(f"CPU: {model} (AMX: {'amx_tile' in flags}); workload {workload.summary()}")
    walls: dict[str, list[float]] = {name: [] for name in modes}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for name, (llm, loras) in modes.items():
            wall, outputs[name] = timed_run(llm, workload.prompts, params, loras)
            walls[name].append(wall)
            log(f"repeat {repeat} {name}: {workload.output_tokens / wall:.1f} tok/s ({wall:.1f} s)")
    tok_s = {name: workload.output_tokens / statistics.fmean(w) for name, w in walls.items()}
    reference = tok_s["base, LoRA off"]
    summary = {name: {"tok_s": v, "vs_base": v / reference, "walls_s": walls[name]} for name, v in tok_s.items()}
    same_base = outputs["base, LoRA on"] == outputs["base, LoRA off"]
    stats = lora.engine.get_stats()
    log(f"base outputs equal with LoRA on and off: {same_base}; adapter slot loads {stats.lora_loads}")
    for name, row in summary.items():
        log(f"{name:>16}: {row['tok_s']:.1f} tok/s, {row['vs_base']:.3f} of the base model's")
    write_json(
        args.out,
        {
            **run_info(started),
            "cpu": model,
            "amx": "amx_tile" in flags,
            "threads": torch.get_num_threads(),
            "workload": workload.summary(),
            "adapters": args.adapters,
            "rank": args.rank,
            "engine": ENGINE,
            "modes": summary,
            "base_outputs_equal": same_base,
        },
    )


if __name__ == "__main__":
    main()
