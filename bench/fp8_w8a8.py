"""FP8 W8A8 against the dense model (issue 53, acceptance 2): greedy agreement and logprob deltas on the real
models, as vLLM's FP8 documentation states them.

For each model (the built-in SmolLM2-135M-Instruct and Gemma 3 270M by default), its float32 weights (the GGUF
file dequantized: the **dense** model) are written as an FP8 checkpoint the way DeepSeek V3's and Qwen3's FP8
releases are (``quant_method: fp8``, every decoder projection in e4m3 with one scale per 128 x 128 block,
``activation_scheme: dynamic``; the embedding, norms and LM head left in float). Then, on the CPU backend,
``--num-prompts`` (32) text prompts:

- **greedy agreement** of ``--max-tokens`` (64) greedy tokens against the dense model's: FP8 weights alone
  (``activation_quantization="off"``) and W8A8 (``"on"``: each projection's input rounded to e4m3, per token in
  groups of 128); identical sequences, the mean common prefix, the first token;
- **logprob deltas:** each prompt followed by the dense model's greedy output, read teacher-forced
  (``prompt_logprobs``): |logprob - dense logprob| of each continuation token (mean, 99th percentile, max).

    .venv/bin/python bench/fp8_w8a8.py --out bench/results/fp8_w8a8.json   # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
from pathlib import Path

import torch
from kv_cache_fp8 import common_prefix, continuation_logprobs, deltas, prompts
from safetensors.torch import save_file

from cb_serve import LLM, SamplingParams
from cb_serve.benchmarks.report import log, run_info, write_json
from cb_serve.model_executor import loader

BLOCK = 128
E4M3_MAX = 448.0
SETTINGS = {"weights only": "off", "w8a8": "on"}


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` as e4m3 codes and a float32 scale per 128 x 128 block (its largest magnitude over 448)."""
    rows, cols = (-(-n // BLOCK) for n in w.shape)
    padded = w.new_zeros(rows * BLOCK, cols * BLOCK)
    padded[: w.shape[0], : w.shape[1]] = w
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    codes = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(padded.shape)[: w.shape[0], : w.shape[1]].contiguous(), scale.float()


def write_fp8_checkpoint(model: str, out: Path) -> Path:
    """``model``'s dense float32 weights as an FP8 checkpoint with 128 x 128 blocks in ``out``."""
    from transformers import AutoTokenizer

    source = loader.resolve_model_source(model)
    config = loader.load_config(source, False)
    hf = loader.hf_from_pretrained(source, config, torch.float32, False)
    tensors = {}
    for name, value in hf.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(value)
        elif not (name == "lm_head.weight" and hf.config.tie_word_embeddings):
            tensors[name] = value.contiguous()
    hf.config.save_pretrained(out)
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
    config_path.write_text(json.dumps(saved))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(source.path, **source.hf_kwargs()).save_pretrained(out)
    return out


def run_model(model: str, args) -> dict:
    texts = prompts(args.num_prompts)
    engine = dict(max_model_len=1024, attention_backend="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out: dict = {"model": model, "greedy_vs_dense": {}, "logprob_delta_vs_dense": {}}
    with tempfile.TemporaryDirectory() as tmp:
        fp8 = str(write_fp8_checkpoint(model, Path(tmp) / "fp8"))
        runs = {"dense": (model, {})} | {k: (fp8, {"activation_quantization": v}) for k, v in SETTINGS.items()}
        tokens, prompt_ids = {}, None
        for name, (path, extra) in runs.items():
            llm = LLM(path, **engine, **extra)
            results = llm.generate(texts, greedy, use_tqdm=False)
            tokens[name] = [list(r.outputs[0].token_ids) for r in results]
            prompt_ids = [list(r.prompt_token_ids) for r in results]
            out.setdefault("weight_bytes", {})[name] = llm.engine.get_stats().weight_bytes
            del llm
        forced = [p + t for p, t in zip(prompt_ids, tokens["dense"])]
        starts = [len(p) for p in prompt_ids]
        logprobs = {}
        for name, (path, extra) in runs.items():
            llm = LLM(path, max_num_batched_tokens=args.chunk, enable_prefix_caching=False, **engine, **extra)
            logprobs[name] = continuation_logprobs(llm, forced, starts)
            del llm
    for name in SETTINGS:
        prefix = [common_prefix(a, b) for a, b in zip(tokens[name], tokens["dense"])]
        out["greedy_vs_dense"][name] = {
            "identical": sum(p == args.max_tokens for p in prefix),
            "of": len(prefix),
            "mean_common_prefix": statistics.fmean(prefix),
            "first_token_agreement": sum(p > 0 for p in prefix) / len(prefix),
        }
        out["logprob_delta_vs_dense"][name] = deltas(logprobs[name], logprobs["dense"])
    log(f"{model}: greedy vs dense {out['greedy_vs_dense']}, logprob deltas {out['logprob_delta_vs_dense']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,gemma-3-270m")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk for the teacher-forced pass")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results = [run_model(m, args) for m in args.models.split(",")]
    write_json(args.out, {**run_info(started), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
