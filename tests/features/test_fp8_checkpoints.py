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


# --- W8A8: the inputs quantized too (``activation_quantization="on"``) ---------------------------------------


def qdq_reference(x: torch.Tensor, kind: str, group: int | None, static: float | None) -> torch.Tensor:
    """vLLM's activation quantization written out per row and group: codes of ``x / scale`` times ``scale``."""
    largest = {"fp8": 448.0, "int8": 127.0}[kind]
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        width = group or x.shape[1]
        for start in range(0, x.shape[1], width):
            part = x[r, start : start + width]
            scale = static if static is not None else max(part.abs().max().item() / largest, 1 / (largest * 512))
            y = (part / scale).clamp(-largest, largest)
            y = y.to(torch.float8_e4m3fn).float() if kind == "fp8" else y.round()
            out[r, start : start + width] = y * scale
    return out


@pytest.mark.parametrize(
    "kind, group, static",
    [
        ("fp8", None, None),
        ("fp8", 32, None),
        ("fp8", 48, None),
        ("fp8", None, 0.01),
        ("int8", None, None),
        ("int8", 32, None),
    ],  # fmt: skip
)
def test_activation_quantization_rounds_as_vllm_does(kind, group, static):
    """Per token, per group (a short last group), static (saturating); a zero row stays zero, and each row's
    numbers are its own: alone or in a batch, the same (no scale over the batch)."""
    from cb_serve.model_executor.layers.activation_quant import ActivationQuant

    torch.manual_seed(1)
    x = torch.randn(5, 80) * torch.tensor([0.01, 1, 30, 1e3, 0])[:, None]
    quant = ActivationQuant(kind, group, static)
    y = quant(x)
    assert torch.equal(y, qdq_reference(x, kind, group, static)) and not y[4].any()
    assert torch.equal(torch.cat([quant(x[i : i + 1]) for i in range(5)]), y)
    if static is None:  # each row's (group's) largest input is a code's largest value exactly
        assert (y.abs().amax(dim=1)[:4] - x.abs().amax(dim=1)[:4]).abs().max() <= 1e-6 * x.abs().max()


def hooked_hf(path: Path, kind: str, group: int | None, scales: dict[str, float] | None):
    """HF float32 on the dequantized checkpoint, each decoder projection's input quantized by the reference first
    (static: q, k, v share the largest of their scales, and gate, up theirs, as vLLM's fused layers do)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fused = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
             "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
             "up_proj": ("gate_proj", "up_proj")}  # fmt: skip
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if name.startswith("model.layers.") and leaf.endswith("_proj"):
            static = None
            if scales is not None:
                static = max(scales[name.removesuffix(leaf) + p] for p in fused.get(leaf, (leaf,)))

            def hook(module, args, static=static):
                x = args[0]
                return (qdq_reference(x.reshape(-1, x.shape[-1]), kind, group, static).view_as(x),)

            module.register_forward_pre_hook(hook)
    return model


def static_scales(weights, config):
    """Each projection a calibrated-looking input scale (different within a fused group), and a static scheme."""
    config["quantization_config"]["activation_scheme"] = "static"
    names = [n.removesuffix(".weight") for n in weights if n.endswith("_proj.weight")]
    for i, name in enumerate(sorted(names)):
        weights[name + ".input_scale"] = torch.tensor(0.006 + 0.002 * (i % 5))


def w8a8_checkpoint(fp8_llama: Path, tmp_path: Path, scheme: str):
    """The checkpoint for ``scheme`` and the HF reference with its rounding hooked in."""
    if scheme == "dynamic":
        return fp8_llama, hooked_hf(fp8_llama, "fp8", BLOCK[1], None)
    path = write_fp8(fp8_llama.parent / "float", tmp_path / "static", static_scales)
    stored = load_file(path / "model.safetensors")
    scales = {n.removesuffix(".input_scale"): float(t) for n, t in stored.items() if n.endswith(".input_scale")}
    return path, hooked_hf(path, "fp8", None, scales)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_w8a8_gives_the_tokens_of_hf_with_its_inputs_quantized(fp8_llama, tmp_path, scheme):
    """With ``activation_quantization="on"`` each projection's input is quantized as vLLM does (dynamic: per token
    in groups of the blocks' width; static: the checkpoint's ``input_scale``): the greedy tokens of HF on the
    dequantized checkpoint with that rounding hooked before each projection (the torch backend, whose inputs to
    the rounding are HF's bit for bit). (Off, the default: HF's own tokens, above.)"""
    path, reference = w8a8_checkpoint(fp8_llama, tmp_path, scheme)
    llm = LLM(str(path), attention_backend="torch", activation_quantization="on", **STRESS_ENGINE_ARGS)
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=11)
    deltas = run_and_compare(llm, reference, prompts, max_tokens, f"w8a8 {scheme}", stop_at_eos=False)
    check_engine_exercised(llm, prompts, deltas)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernels did not build")
def test_w8a8_on_the_cpu_backend_keeps_the_fp8_weights_and_hf_s_numbers(fp8_llama):
    """On the C++ backend the weights stay FP8 and the inputs are rounded first. Its float32 sums differ from HF's
    in the last bits, and a rounding step (1/16 of a value in e4m3) turns a last-bit difference at a code's
    boundary into a visible one, so greedy paths may part where HF's are not tied: the teacher-forced
    logprobs are compared, which stay close (an order of magnitude closer than without the rounding)."""
    reference = hooked_hf(fp8_llama, "fp8", BLOCK[1], None)
    llm = LLM(str(fp8_llama), attention_backend="cpu", activation_quantization="on", max_model_len=256)
    assert "fp8_e4m3" in llm.engine.get_stats().weight_bytes
    torch.manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in (7, 40, 120, 200)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    deltas = []
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        ours = torch.tensor([out.prompt_logprobs[j][prompt[j]].logprob for j in range(1, len(prompt))])
        deltas.append((ours - logits[torch.arange(len(prompt) - 1), prompt[1:]]).abs())
    deltas = torch.cat(deltas)
    assert deltas.mean() < 0.02 and deltas.max() < 0.5, (deltas.mean(), deltas.max())


def test_w8a8_changes_the_numbers_only_when_on(fp8_llama):
    """auto (no native FP8 GEMM yet) and off give the dequantized model's logprobs; on gives others."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    prompt = [list(range(100, 140))]
    runs = {s: greedy_outputs(fp8_llama, prompt, params, activation_quantization=s) for s in ("auto", "off", "on")}
    logprob = {s: next(iter(r[0][1][0].values())).logprob for s, r in runs.items()}
    assert logprob["auto"] == logprob["off"] != logprob["on"], logprob


def static_without_scales(weights, config):
    config["quantization_config"]["activation_scheme"] = "static"


def per_channel_input_scale(weights, config):
    static_scales(weights, config)
    weights["model.layers.0.mlp.up_proj.input_scale"] = torch.full((64,), 0.01)


@pytest.mark.parametrize(
    "edit, match",
    [
        (static_without_scales, r"quantizes activations statically, and has no model\.layers\.\d\..*input_scale"),
        (per_channel_input_scale, r"up_proj\.input_scale: only one input scale per layer is supported"),
    ],
)
def test_a_static_scheme_without_its_scales_is_refused(fp8_llama, tmp_path, edit, match):
    """(Only where the scales would be used: with the weights alone it loads, as transformers loads it.)"""
    broken = write_fp8(fp8_llama.parent / "float", tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=match):
        LLM(str(broken), max_model_len=128, num_gpu_blocks=16, activation_quantization="on")
    LLM(str(broken), max_model_len=128, num_gpu_blocks=16).engine.shutdown()
