"""FP8 checkpoints (``quant_method: fp8``, as Qwen3's and DeepSeek V3's FP8 releases store them): every
projection ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per block (here 32 x 32 on the tiny model, 128
x 128 as published), the embedding, norms and LM head left in float. The random weights are quantized here
by the format's rule (a block's scale is its largest magnitude over 448, e4m3's largest value), so the
checkpoint is a well-defined float model: transformers dequantizes it on a CPU, and the engine, which reads
each slice with its blocks' scales (``quantization/fp8.py``; on the C++ backend keeping them as FP8 groups),
gives HF's greedy tokens under the stress workload, on both backends and over two ranks (each reading its row
or column slices of the file, cut mid-block). A malformed checkpoint or ``quantization_config`` is a clear
error at load."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from exactness import check_engine_exercised, make_prompts, run_and_compare
from models import STRESS_ENGINE_ARGS, assert_same_greedy, greedy_outputs, make_random_model
from safetensors.torch import load_file, save_file

from cb_serve import LLM, SamplingParams, cpu_ops

BLOCK = [32, 32]
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
E4M3_MAX = 448.0


def fp8_quantize(w: torch.Tensor, block: list[int] | str = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` -> e4m3 values and float32 scales ``[ceil(out / b0), ceil(in / b1)]``; ``block`` "row": one
    scale per output row ``[out, 1]``, "tensor": one for the tensor ``[1]``."""
    if isinstance(block, str):
        amax = w.abs().amax(dim=1, keepdim=True) if block == "row" else w.abs().amax().reshape(1)
        scale = (amax / E4M3_MAX).clamp(min=1e-12)
        return (w / scale.reshape(-1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.float()
    grid = [math.ceil(n / b) for n, b in zip(w.shape, block)]
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[: w.shape[0], : w.shape[1]] = w
    blocks = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[: w.shape[0], : w.shape[1]].contiguous(), scale.float()


def write_fp8(model_dir: Path, out: Path, edit=None, block: list[int] | str = BLOCK) -> Path:
    """``model_dir``'s projections quantized into ``out`` (``edit(weights, config)`` may break it first)."""
    shutil.copytree(model_dir, out)
    weights, fp8 = load_file(out / "model.safetensors"), {}
    for name, w in weights.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            fp8[name], fp8[name + "_scale_inv"] = fp8_quantize(w, block)
        else:
            fp8[name] = w
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {**FP8_CONFIG, "weight_block_size": block if isinstance(block, list) else None}
    if edit is not None:
        edit(fp8, config)
    save_file(fp8, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory, tokenizer):
    base = tmp_path_factory.mktemp("fp8")
    return write_fp8(make_random_model(base / "float", "llama", tokenizer), base / "fp8")


@pytest.mark.parametrize("block", [BLOCK, "row", "tensor"])
def test_the_weights_are_transformers_dequantization(fp8_llama, tmp_path, block):
    """Each weight the engine loads equals, bit for bit, what transformers dequantizes (float32, on a CPU): in
    blocks, per output row, per tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cb_serve.model_executor.layers.checkpoint import LazyCheckpoint, safetensors_files
    from cb_serve.model_executor.quantization import quantization_config

    path = fp8_llama if block == BLOCK else write_fp8(fp8_llama.parent / "float", tmp_path / "fp8", block=block)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    quant = quantization_config(AutoConfig.from_pretrained(path))
    ours = quant.weights(LazyCheckpoint(safetensors_files(str(path)), torch.float32), torch.float32)
    names = [n for n in ours if n.endswith("_proj.weight")]
    assert len(names) == 14 and not any("scale" in n for n in ours)
    for name in names:
        assert torch.equal(ours[name][:], hf[name]), name
        assert torch.equal(ours[name][8:24, 40:], hf[name][8:24, 40:]), name  # a slice cut mid-block


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_an_fp8_checkpoint_gives_hf_s_greedy_tokens(fp8_llama, backend):
    """On the C++ backend the projections stay FP8 (``fp8_e4m3``: the codes and their blocks' scales, 1.125 bytes
    a weight, multiplied in registers), and the tokens are still HF's."""
    llm = LLM(str(fp8_llama), attention_backend=backend, **STRESS_ENGINE_ARGS)
    kept = "fp8_e4m3" in llm.engine.get_stats().weight_bytes
    assert kept == (backend == "cpu" and cpu_ops.available()), llm.engine.get_stats().weight_bytes
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=5)
    deltas = run_and_compare(llm, fp8_llama, prompts, max_tokens, f"fp8 {backend}", stop_at_eos=False)
    check_engine_exercised(llm, prompts, deltas)


def test_an_fp8_checkpoint_over_two_ranks(fp8_llama):
    """Each rank reads its slices (k/v rows split mid-block, o/down columns) with their scales."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    prompts = [list(range(100, 130)), list(range(300, 310)), list(range(50, 150, 3))]

    two, one = (greedy_outputs(fp8_llama, prompts, params, tensor_parallel_size=n) for n in (2, 1))
    assert_same_greedy(two, one, "fp8 over two ranks")


def drop_a_scale(weights, config):
    del weights["model.layers.1.mlp.down_proj.weight_scale_inv"]


def wrong_scale_shape(weights, config):
    weights["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 2)


def unknown_method(weights, config):
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}


def no_quantization_config(weights, config):
    del config["quantization_config"]


def bad_block(weights, config):
    config["quantization_config"]["weight_block_size"] = [32]


@pytest.mark.parametrize(
    "edit, match",
    [
        (drop_a_scale, r"layers\.1\.mlp\.down_proj\.weight is stored in torch.float8_e4m3fn .* no scales"),
        (wrong_scale_shape, r"q_proj\.weight: a weight of shape \[64, 64\] in 32x32 blocks needs scales \[2, 2\]"),
        (unknown_method, r"quant_method 'bitsandbytes', which cb-serve cannot load yet; supported: fp8"),
        (no_quantization_config, r"_proj\.weight is stored in FP8, and the checkpoint's config names no quantiz"),
        (bad_block, r"weight_block_size must be two positive integers"),
    ],
)
def test_a_malformed_checkpoint_is_a_clear_error_at_load(fp8_llama, tmp_path, edit, match):
    broken = write_fp8(fp8_llama.parent / "float", tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=match):
        LLM(str(broken), max_model_len=128, num_gpu_blocks=16)


def test_e8m0_byte_scales_and_fp8_tensors_it_cannot_read():
    """Scales stored as bytes are E8M0 exponents (MXFP8's), decoded as transformers does; an FP8 tensor that is
    no 2-D weight (fused experts) is refused, never cast."""
    from cb_serve.model_executor.quantization import Fp8Config

    torch.manual_seed(0)
    q = (torch.randn(64, 96) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    exponents = torch.randint(118, 136, (2, 3), dtype=torch.uint8)
    state = {"a.weight": q, "a.weight_scale_inv": exponents, "experts.gate_up_proj": q[None]}
    weights = Fp8Config((32, 32)).weights(state, torch.float32)
    expected = q.float() * (exponents.float() - 127).exp2().repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(weights["a.weight"][:], expected) and list(weights) == ["a.weight", "experts.gate_up_proj"]
    with pytest.raises(ValueError, match="experts.gate_up_proj is stored in torch.float8_e4m3fn, which is not read"):
        weights["experts.gate_up_proj"]
