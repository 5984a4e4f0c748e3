"""compressed-tensors checkpoints (llm-compressor's format, ``quant_method: compressed-tensors``), built here with
the ``compressed-tensors`` library's own packing and checked against its own decompression and against
transformers (which loads them through that library):

- ``pack-quantized`` W4A16 in groups of 32 inputs, symmetric, and asymmetric (zero points packed along the
  output dimension, which transformers 5.24 itself cannot load), and W8A16 per output row;
- ``naive-quantized`` INT8 (unpacked) in groups with zero points;
- ``float-quantized`` FP8 per output row.

The engine's weights equal the library's decompression bit for bit, also for slices cut mid-group and
mid-word; its greedy tokens are HF's under the stress workload, on both backends and over two ranks."""

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

pytest.importorskip(
    "compressed_tensors", reason="the compressed-tensors library (the format's oracle) is a dev dependency"
)
GROUP = 32


def scheme(bits: int, kind: str, strategy: str, symmetric: bool) -> dict:
    weights = {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy, "dynamic": False}
    return weights | ({"group_size": GROUP} if strategy == "group" else {})


CASES = {  # name: (format, weights' arguments)
    "w4_group": ("pack-quantized", scheme(4, "int", "group", True)),
    "w4_group_asym": ("pack-quantized", scheme(4, "int", "group", False)),
    "w4_group_bf16": ("pack-quantized", scheme(4, "int", "group", True)),  # bfloat16 scales, as published
    "w8_channel": ("pack-quantized", scheme(8, "int", "channel", True)),
    "w8_naive_asym": ("naive-quantized", scheme(8, "int", "group", False)),
    "fp8_channel": ("float-quantized", scheme(8, "float", "channel", True)),
}


SCALE_DTYPES = {"w4_group_bf16": torch.bfloat16}  # else float32


def quantize(w: torch.Tensor, fmt: str, args: dict, scale_dtype=torch.float32) -> dict[str, torch.Tensor]:
    """One weight's compressed tensors (suffixes after ``weight``), by the scheme's rule."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, inputs = w.shape
    size = GROUP if args["strategy"] == "group" else inputs
    g = w.reshape(out, inputs // size, size)
    if args["type"] == "float":
        scale = (g.abs().amax(-1) / 448.0).clamp(min=1e-12)
        q = (g / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(out, inputs)
        return {"": q, "_scale": scale.float()}
    bits = args["num_bits"]
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if args["symmetric"]:
        scale, zero = (g.abs().amax(-1) / hi).clamp(min=1e-8).to(scale_dtype).float(), torch.zeros(out, inputs // size)
    else:
        mn, mx = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((mx - mn) / (hi - lo)).clamp(min=1e-8).to(scale_dtype).float()
        zero = torch.round(lo - mn / scale).clamp(lo, hi)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(lo, hi).to(torch.int8).reshape(out, inputs)
    if fmt == "naive-quantized":  # int8 as they are
        return {"": q, "_scale": scale.float()} | ({} if args["symmetric"] else {"_zero_point": zero.to(torch.int8)})
    tensors = {
        "_packed": pack_to_int32(q, bits),
        "_scale": scale.to(scale_dtype),
        "_shape": torch.tensor([out, inputs]),
    }
    if not args["symmetric"]:
        tensors["_zero_point"] = pack_to_int32(zero.to(torch.int8), bits, packed_dim=0)
    return tensors


def write_compressed(model_dir: Path, out: Path, case: str, edit=None) -> Path:
    fmt, args = CASES[case][0], dict(CASES[case][1])
    shutil.copytree(model_dir, out)
    weights, saved = load_file(out / "model.safetensors"), {}
    for name, w in weights.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            saved |= {
                name + suffix: t for suffix, t in quantize(w, fmt, args, SCALE_DTYPES.get(case, torch.float32)).items()
            }
        else:
            saved[name] = w
    config = json.loads((out / "config.json").read_text())
    group = {"targets": ["Linear"], "weights": args, "input_activations": None, "output_activations": None}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": ["lm_head"],
        "config_groups": {"group_0": group},
        "quantization_status": "compressed",
    }
    if edit is not None:
        edit(saved, config["quantization_config"])
    save_file(saved, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    base = tmp_path_factory.mktemp("compressed")
    float_dir = make_random_model(base / "float", "llama", tokenizer)
    return float_dir, {case: write_compressed(float_dir, base / case, case) for case in CASES}


def library_weights(path: Path, case: str) -> dict[str, torch.Tensor]:
    """Each projection as the compressed-tensors library decompresses it in a float32 model (transformers
    upcasts the scales to the model's dtype)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    fmt, args = CASES[case]
    compressor, tensors = BaseCompressor.load_from_registry(fmt), load_file(path / "model.safetensors")
    scheme_ = QuantizationScheme(targets=["Linear"], weights=args)
    out = {}
    for name in {n.rsplit(".weight", 1)[0] for n in tensors if n.startswith("model.layers.") and "_proj." in n}:
        local = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
        local = {k: v.float() if k == "weight_scale" else v for k, v in local.items()}  # a float32 model's scales
        out[name + ".weight"] = compressor.decompress(local, scheme_)["weight"]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_weights_are_the_library_s_decompression(checkpoints, case):
    from cb_serve.model_executor.layers.checkpoint import LazyCheckpoint, safetensors_files
    from cb_serve.model_executor.quantization import quantization_config

    path = checkpoints[1][case]
    config = type(
        "Config", (), {"quantization_config": json.loads((path / "config.json").read_text())["quantization_config"]}
    )
    ours = quantization_config(config).weights(
        LazyCheckpoint(safetensors_files(str(path)), torch.float32), torch.float32
    )
    reference = library_weights(path, case)
    assert len(reference) == 14 and not any(n.endswith(("_packed", "_scale", "_shape", "_zero_point")) for n in ours)
    for name, ref in reference.items():
        assert name in ours and torch.equal(ours[name][:], ref.float()), name
        assert torch.equal(ours[name][5:27, 13:61], ref.float()[5:27, 13:61]), name  # cut mid-group, mid-word
        assert torch.equal(ours[name][1:7], ref.float()[1:7]), name  # rows within one word of zero points


@pytest.mark.parametrize("case, backend", [("w4_group", "torch"), ("w4_group", "cpu"), ("w4_group_bf16", "cpu")])
def test_a_w4a16_checkpoint_gives_hf_s_greedy_tokens(checkpoints, case, backend):
    """(bfloat16 scales, as published, on the C++ backend: the projections are kept as their 4-bit groups.)"""
    path = checkpoints[1][case]
    llm = LLM(str(path), attention_backend=backend, **STRESS_ENGINE_ARGS)
    kept = llm.engine.get_stats().weight_bytes.get("q4_groups", 0) > 0
    assert kept == (case == "w4_group_bf16" and cpu_ops.available()), llm.engine.get_stats().weight_bytes
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=7)
    deltas = run_and_compare(llm, path, prompts, max_tokens, f"{case} {backend}", stop_at_eos=False)
    check_engine_exercised(llm, prompts, deltas)


def test_an_asymmetric_w4a16_checkpoint_over_two_ranks(checkpoints):
    """(transformers 5.24 cannot load packed zero points itself: the reference is one rank, whose weights the
    library's decompression checks above.)"""
    path = checkpoints[1]["w4_group_asym"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    prompts = [list(range(100, 130)), list(range(300, 310)), list(range(50, 150, 3))]

    two, one = (greedy_outputs(path, prompts, params, tensor_parallel_size=n) for n in (2, 1))
    assert_same_greedy(two, one, "w4a16 over two ranks")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda w, q: q.update(sparsity_config={"format": "sparse-24"}), "sparsity_config are not supported"),
        (lambda w, q: q.update(format="marlin-24"), "format 'marlin-24' is not supported yet"),
        (lambda w, q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder: group"),
        (lambda w, q: w.pop("model.layers.0.mlp.up_proj.weight_scale"), r"up_proj\.weight is stored quantized"),
    ],
)
def test_what_it_cannot_read_is_refused_at_load(checkpoints, tmp_path, edit, match):
    broken = write_compressed(checkpoints[0], tmp_path / "broken", "w4_group", edit)
    with pytest.raises(ValueError, match=match):
        LLM(str(broken), max_model_len=128, num_gpu_blocks=16)


@pytest.mark.parametrize(
    "args, expected",
    [
        (None, None),
        ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}, ("fp8", True, None)),
        ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}, ("fp8", True, None)),
        ({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}, ("fp8", True, 128)),
        ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}, ("fp8", False, None)),
        ({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}, ("int8", True, None)),
        ({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": False}, "not supported"),
        ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "dynamic": "local"}, "not supported"),
        ({"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False}, "strategy 'channel'"),
    ],
)
def test_input_activations_read_as_w8a8_schemes(args, expected):
    """A scheme's ``input_activations`` (W8A8): FP8 or symmetric INT8, dynamic per token (per tensor: per token
    too, so no request's numbers depend on its batch) or per group, or static per tensor; others refused."""
    from cb_serve.model_executor.quantization.compressed_tensors import activation_scheme

    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            activation_scheme(args)
        return
    scheme = activation_scheme(args)
    assert (scheme and (scheme.kind, scheme.dynamic, scheme.group_size)) == expected


def test_input_activations_it_cannot_apply_leave_the_weights_loadable():
    """Refused only where they would be applied (``activation_quantization="on"``, the loader); the weights alone
    load as transformers loads them."""
    from cb_serve.model_executor.quantization.compressed_tensors import CompressedTensorsConfig

    group = {"weights": scheme(8, "float", "channel", True),
             "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
                                   "symmetric": False}}  # fmt: skip
    config = CompressedTensorsConfig.from_hf({"format": "float-quantized", "config_groups": {"group_0": group}})
    assert config.activations is None and "not supported" in config.activation_refusal
