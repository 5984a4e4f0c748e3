"""GPTQ and AWQ checkpoints (``quant_method: gptq`` / ``awq``), built here by the formats' published packing
(AutoGPTQ's ``pack``: integers along the input dimension, zero points along the output, the original format's
``zero - 1``; AutoAWQ's GEMM ``pack``: eight values a word along the output dimension in the order
``[0, 2, 4, 6, 1, 3, 5, 7]``), with float16 scales as published:

- AWQ, 4 bits in groups of 32 with zero points;
- GPTQ (original format), 4 bits in groups of 32, symmetric, activation order (``desc_act``: ``g_idx`` a
  permutation of the groups);
- GPTQ v2, 8 bits, one group per row, asymmetric;
- GPTQ, 8 bits in groups of 32, symmetric (zero 128).

The engine's weights equal the formats' dequantization ``(q - zero) * scale`` in float32, also for slices
cut mid-group and mid-word; its greedy tokens are HF float32's running the same weights dequantized, under
the stress workload, on both backends and over two ranks. (transformers loads these formats only through
GPTQModel, which does not install beside our CPU torch: the reference is the dequantized checkpoint.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from exactness import check_engine_exercised, make_prompts, run_and_compare
from models import STRESS_ENGINE_ARGS, assert_same_greedy, greedy_outputs, make_random_model
from safetensors.torch import load_file, save_file

from cb_serve import LLM, SamplingParams, cpu_ops

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
CASES = {  # name: quantization_config (the group size and zero points' kind drive the packing below)
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "gptq_act_order": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": True,
        "sym": True,
        "checkpoint_format": "gptq",
    },  # fmt: skip
    "gptq_v2_int8": {
        "quant_method": "gptq",
        "bits": 8,
        "group_size": -1,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq_v2",
    },  # fmt: skip
    "gptq_sym_int8": {
        "quant_method": "gptq",
        "bits": 8,
        "group_size": 32,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    },  # fmt: skip
}


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int ``[rows, n]`` (unsigned ``bits``-bit) -> int32 ``[rows, n * bits / 32]``: value ``j`` of a word at
    bits ``j * bits`` (AutoGPTQ's ``pack``, along whichever dimension the caller puts last)."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    words = sum(v[..., j] << (bits * j) for j in range(per))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement into int32


def quantize(w: torch.Tensor, config: dict, gen: torch.Generator,
             order: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """One ``[out, in]`` weight's checkpoint tensors (suffixes after the layer's prefix) and the float32 weight
    they dequantize to (``(q - zero) * scale`` in float32: the float16 scales upcast, as a float32 model has them).
    ``order``: the activation order's permutation of the inputs (``desc_act``; random where not given)."""
    out, inputs = w.shape
    bits, group = config["bits"], config["group_size"] if config["group_size"] > 0 else inputs
    top, groups = (1 << bits) - 1, inputs // group
    if config.get("desc_act"):  # activation order: input perm[i] in group i // group
        g_idx = torch.empty(inputs, dtype=torch.int32)
        order = torch.randperm(inputs, generator=gen) if order is None else order
        g_idx[order] = torch.arange(inputs, dtype=torch.int32) // group
    else:
        g_idx = torch.arange(inputs, dtype=torch.int32) // group
    wt = w.t()  # [in, out]
    members = [wt[g_idx == g] for g in range(groups)]
    if config.get("sym"):
        scale = torch.stack([(m.abs().amax(0) / (top // 2)).clamp(min=1e-6) for m in members]).half()
        zero = torch.full((groups, out), (top + 1) // 2, dtype=torch.int64)
    else:
        lo = torch.stack([m.amin(0).clamp(max=0) for m in members])
        hi = torch.stack([m.amax(0).clamp(min=0) for m in members])
        scale = ((hi - lo) / top).clamp(min=1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(0, top).to(torch.int64)
    q = (torch.round(wt / scale.float()[g_idx]) + zero[g_idx]).clamp(0, top).to(torch.int64)  # [in, out]
    dequantized = ((q - zero[g_idx]).float() * scale.float()[g_idx]).t().contiguous()
    if config["quant_method"] == "awq":
        interleave = torch.arange(out).view(-1, 8)[:, AWQ_ORDER].reshape(-1)  # word c's nibble i: 8c + ORDER[i]
        tensors = {"qweight": pack_words(q[:, interleave], 4), "qzeros": pack_words(zero[:, interleave], 4)}
    else:
        stored_zero = zero - 1 if config["checkpoint_format"] == "gptq" else zero
        tensors = {"qweight": pack_words(q.t(), bits).t().contiguous(), "qzeros": pack_words(stored_zero, bits),
                   "g_idx": g_idx}  # fmt: skip
    return tensors | {"scales": scale}, dequantized


def write_checkpoints(model_dir: Path, base: Path, case: str, edit=None) -> tuple[Path, Path]:
    """The ``case`` checkpoint of ``model_dir``'s projections, and the float checkpoint of its dequantized
    weights (HF's reference)."""
    config, gen = CASES[case], torch.Generator().manual_seed(3)
    quantized, reference = base / case, base / f"{case}_dequantized"
    for d in (quantized, reference):
        shutil.copytree(model_dir, d)
    weights, saved, floats = load_file(model_dir / "model.safetensors"), {}, {}
    orders: dict[tuple[str, str], torch.Tensor] = {}
    for name, w in weights.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            prefix = name[: -len("weight")]
            # projections of one input share its activation order (GPTQ sorts by that input's Hessian)
            role = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(name.split(".")[-2])
            key = (name.split(".")[2], role or name.split(".")[-2])
            order = orders.setdefault(key, torch.randperm(w.shape[1], generator=gen))
            tensors, floats[name] = quantize(w, config, gen, order)
            saved |= {prefix + part: t for part, t in tensors.items()}
        else:
            saved[name] = floats[name] = w
    meta = json.loads((quantized / "config.json").read_text())
    meta["quantization_config"] = dict(config)
    if edit is not None:
        edit(saved, meta["quantization_config"])
    save_file(saved, quantized / "model.safetensors", metadata={"format": "pt"})
    (quantized / "config.json").write_text(json.dumps(meta))
    save_file(floats, reference / "model.safetensors", metadata={"format": "pt"})
    return quantized, reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    base = tmp_path_factory.mktemp("gptq_awq")
    float_dir = make_random_model(base / "float", "llama", tokenizer)
    return float_dir, {case: write_checkpoints(float_dir, base, case) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_the_weights_are_the_format_s_dequantization(checkpoints, case):
    from cb_serve.model_executor.layers.checkpoint import LazyCheckpoint, safetensors_files
    from cb_serve.model_executor.quantization import quantization_config

    path, reference_dir = checkpoints[1][case]
    config = type("Config", (), {"quantization_config": CASES[case]})
    ours = quantization_config(config).weights(
        LazyCheckpoint(safetensors_files(str(path)), torch.float32), torch.float32
    )
    reference = load_file(reference_dir / "model.safetensors")
    assert not any(n.endswith(("qweight", "qzeros", "scales", "g_idx")) for n in ours)
    projections = [n for n in reference if n.endswith("_proj.weight")]
    assert len(projections) == 14 and all(n in ours for n in reference)
    for name in projections:
        ref = reference[name]
        assert list(ours[name].shape) == list(ref.shape) and torch.equal(ours[name][:], ref), name
        assert torch.equal(ours[name][5:27, 13:61], ref[5:27, 13:61]), name  # cut mid-group, mid-word
        assert torch.equal(ours[name][3:5, 40:41], ref[3:5, 40:41]), name  # within one word both ways


@pytest.mark.parametrize(
    "case, backend", [("awq", "cpu"), ("gptq_act_order", "torch"), ("gptq_act_order", "cpu"), ("gptq_sym_int8", "cpu")]
)
def test_a_checkpoint_gives_hf_s_greedy_tokens_on_its_dequantized_weights(checkpoints, case, backend):
    path, reference = checkpoints[1][case]
    llm = LLM(str(path), attention_backend=backend, **STRESS_ENGINE_ARGS)
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=11)
    deltas = run_and_compare(llm, reference, prompts, max_tokens, f"{case} {backend}", stop_at_eos=False)
    check_engine_exercised(llm, prompts, deltas)


def test_int4_groups_stay_4_bit_on_the_cpu(checkpoints):
    """With the C++ kernels, AWQ's and GPTQ's 4-bit projections keep only their groups (``q4_groups``: 0.75 bytes a
    weight; ``fma(scale, q, -zero * scale)`` is each weight exactly): the HF-equal tokens above come from them.
    Symmetric 8 bits keep theirs too (``q8_groups``: ``q - 128`` in int8, 1.125 bytes), and activation order (groups
    that differ within 32 inputs) as its inputs sorted by group (``x[:, perm]`` times them). Asymmetric 8 bits
    (``q - zero`` past int8) stay float32."""
    if not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here")
    float_bytes = LLM(str(checkpoints[0]), max_model_len=128, num_gpu_blocks=16).engine.get_stats().weight_bytes
    kinds = {"awq": ("q4_groups", 0.75), "gptq_act_order": ("q4_groups", 0.75), "gptq_sym_int8": ("q8_groups", 1.125)}
    for case in ("awq", "gptq_act_order", "gptq_v2_int8", "gptq_sym_int8"):
        llm = LLM(str(checkpoints[1][case][0]), max_model_len=128, num_gpu_blocks=16)
        weights = llm.engine.get_stats().weight_bytes
        if case in kinds:
            kind, per_weight = kinds[case]
            projections = float_bytes["float32"] - weights["float32"]  # the float32 bytes the groups replaced
            assert projections > 0 and weights[kind] * 4 <= projections * per_weight * 1.1, weights
        else:
            assert weights == float_bytes, (case, weights)


@pytest.mark.parametrize("case", ["gptq_v2_int8", "awq"])
def test_over_two_ranks_each_reads_its_slices(checkpoints, case):
    """Each rank dequantizes only its rows or columns (mid-group, mid-word for the smaller projections): the
    same tokens and logprobs as the float checkpoint of the same weights on one rank."""
    path, reference = checkpoints[1][case]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    prompts = [list(range(100, 130)), list(range(300, 310)), list(range(50, 150, 3))]
    two, one = greedy_outputs(path, prompts, params, tensor_parallel_size=2), greedy_outputs(reference, prompts, params)
    assert_same_greedy(two, one, f"{case} over two ranks")


def _drop(name: str):
    return lambda w, q: w.pop(name)


@pytest.mark.parametrize(
    "case, edit, match",
    [
        ("awq", lambda w, q: q.update(version="gemv"), "version 'gemv'"),
        ("awq", lambda w, q: q.update(zero_point=False), "without zero points"),
        ("gptq_act_order", lambda w, q: q.update(bits=3), "3-bit weights are not supported"),
        ("gptq_act_order", lambda w, q: q.update(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
        ("gptq_act_order", _drop("model.layers.0.mlp.up_proj.scales"), r"no model\.layers\.0\.mlp\.up_proj\.scales"),
        (
            "awq",
            lambda w, q: w.update({"model.layers.1.self_attn.o_proj.scales": torch.ones(3, 64).half()}),
            r"o_proj\.weight: .* needs scales of shape",
        ),  # fmt: skip
        ("gptq_act_order", lambda w, q: w["model.layers.0.self_attn.q_proj.g_idx"].fill_(99), "g_idx names groups"),
    ],
)
def test_what_it_cannot_read_is_refused_at_load(checkpoints, tmp_path, case, edit, match):
    broken, _ = write_checkpoints(checkpoints[0], tmp_path, case, edit)
    with pytest.raises(ValueError, match=match):
        LLM(str(broken), max_model_len=128, num_gpu_blocks=16)
