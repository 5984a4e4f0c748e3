"""Mixture-of-experts checkpoints in the layouts they ship in.

- **gpt-oss in MXFP4**, as openai/gpt-oss-20b stores its experts (checked against transformers'
  ``integrations/mxfp4.py::_convert_moe_packed_tensors`` and the real checkpoint's tensors, e.g.
  ``gate_up_proj_blocks`` U8 ``[32, 5760, 90, 16]``): ``mlp.experts.{gate_up,down}_proj_blocks`` uint8
  ``[E, out, in / 32, 16]``, two FP4 e2m1 codes a byte (the low nibble the even element), and ``_scales``
  uint8 ``[E, out, in / 32]``, one e8m0 exponent (bias 127) per 32 values; ``quantization_config``
  ``quant_method: mxfp4``. The random experts are quantized here, so the checkpoint is a well-defined float
  model: transformers dequantizes it on CPU (no ``kernels`` package needed) to exactly our dequantization,
  the engine's greedy outputs are HF's under the stress workload, and its log-probabilities are bit for bit
  those of a float32 checkpoint holding our dequantized weights (so its expert weights are those). Over two
  ranks, which read their slices of the file lazily and dequantize them themselves (``moe_weights.mxfp4``),
  the outputs are the float32 twin's.
- **Per-expert and fused layouts**: Qwen3-MoE (``mlp.experts.{e}.gate_proj``...) and Mixtral
  (``block_sparse_moe.experts.{e}.w1/w2/w3``) as saved, and re-saved in transformers v5's fused layout
  (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, Mixtral's router as ``mlp.gate``),
  give the same greedy tokens and log-probabilities (within ``LOGPROB_ATOL``: the ranks' all-reduce sums in
  another order), one layout served over two ranks that read their slices straight from the safetensors
  file (``checkpoint.LazyCheckpoint``): fused for Qwen3-MoE, per expert (w1/w2/w3) for Mixtral, the other
  layout loaded through transformers.
- **A bf16 checkpoint** (Qwen3-MoE ships in bf16), served in float32: every weight is then exact in bf16, so
  the engine keeps experts and projections at 2 bytes a weight (``cpu_ops.pack_expert_weight``), decode rows
  bit for bit as from float32 copies, larger batches on AMX tiles where the CPU has them; greedy tokens are
  HF float32's under the stress workload.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from exactness import check_engine_exercised, make_prompts, run_and_compare
from models import STRESS_ENGINE_ARGS, assert_same_greedy, make_random_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cb_serve import LLM, SamplingParams, cpu_ops

FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_CONFIG = {  # openai/gpt-oss-20b's
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
PROMPTS = [list(range(100, 130)), list(range(300, 310)), list(range(50, 150, 3)), list(range(100, 120)) + [7, 8, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=2)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` -> blocks ``[..., K / 32, 16]``, scales ``[..., K / 32]``: per 32 values the least power of
    two 2^s bringing them within +-6, each value then rounded to the nearest e2m1 code."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    s = torch.log2(groups.abs().amax(-1, keepdim=True) / 6).ceil()
    codes = (groups / torch.exp2(s)).unsqueeze(-1).sub(FP4_E2M1).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | codes[..., 1::2] << 4, (s.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()
    return (FP4_E2M1[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)


def resave(src: Path, dst: Path, weights: dict[str, torch.Tensor], **config) -> Path:
    """``src``'s config and tokenizer with ``weights`` as its checkpoint and ``config`` added to config.json."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    return dst


def greedy(model_dir: Path, **engine_args) -> list[tuple[list[int], list[dict]]]:
    llm = LLM(str(model_dir), **STRESS_ENGINE_ARGS, **engine_args)
    try:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory, tokenizer) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The random gpt-oss with MXFP4 experts, a float32 twin holding their dequantized values, and those values."""
    base = make_random_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", tokenizer)
    weights = load_file(base / "model.safetensors")
    packed, dequantized = {}, {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # HF's [E, in, out] (x @ w); the checkpoint quantizes along `in`, one row per output feature
        blocks, scales = mxfp4_quantize(weights.pop(name).transpose(1, 2))
        packed |= {f"{name}_blocks": blocks.contiguous(), f"{name}_scales": scales.contiguous()}
        dequantized[name] = mxfp4_dequantize(blocks, scales).transpose(1, 2).contiguous()
    mxfp4 = resave(base, tmp_path_factory.mktemp("mxfp4"), weights | packed, quantization_config=MXFP4_CONFIG)
    twin = resave(base, tmp_path_factory.mktemp("dequantized"), weights | dequantized)
    with safe_open(mxfp4 / "model.safetensors", "pt") as f:  # E = 8, H = 64, I = 128
        layout = {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys() if "0.mlp.experts" in n}
    prefix = "model.layers.0.mlp.experts."
    assert layout == {
        prefix + "gate_up_proj_blocks": ("U8", [8, 256, 2, 16]),
        prefix + "gate_up_proj_scales": ("U8", [8, 256, 2]),
        prefix + "gate_up_proj_bias": ("F32", [8, 256]),
        prefix + "down_proj_blocks": ("U8", [8, 64, 4, 16]),
        prefix + "down_proj_scales": ("U8", [8, 64, 4]),
        prefix + "down_proj_bias": ("F32", [8, 64]),
    }
    return mxfp4, twin, dequantized


def test_an_mxfp4_gpt_oss_checkpoint_serves_as_hf_dequantizes_it(mxfp4_gpt_oss):
    from transformers import AutoModelForCausalLM

    model_dir, _, dequantized = mxfp4_gpt_oss
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # on CPU: dequantized as loaded
    state = hf.state_dict()
    assert all(torch.equal(state[name], w) for name, w in dequantized.items())
    llm = LLM(str(model_dir), **STRESS_ENGINE_ARGS)
    kept = llm.engine.get_stats().weight_bytes.get("mxfp4_groups", 0)  # on the CPU: the experts' FP4 codes
    assert kept == (5 * sum(w.numel() for w in dequantized.values()) // 8 if cpu_ops.available() else 0)
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=11)
    deltas = run_and_compare(llm, hf, prompts, max_tokens, "gpt-oss mxfp4", stop_at_eos=False)
    check_engine_exercised(llm, prompts, deltas)


def test_the_engine_holds_the_dequantized_experts(mxfp4_gpt_oss):
    """Public behaviour only: bit-equal log-probabilities on both checkpoints, where any expert weight
    that differed and was routed to would move them (8 experts, top 2, every token of every prompt)."""
    model_dir, twin, _ = mxfp4_gpt_oss
    assert greedy(model_dir) == greedy(twin)


def test_an_mxfp4_checkpoint_over_two_ranks(mxfp4_gpt_oss):
    model_dir, twin, _ = mxfp4_gpt_oss
    assert_same_greedy(greedy(model_dir, tensor_parallel_size=2), greedy(twin), "gpt-oss mxfp4 over two ranks")


def fused_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers v5's names: each block's experts stacked, gate then up rows fused; Mixtral's block as ``mlp``."""
    role = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
    out, experts = {}, defaultdict(dict)
    for name, w in weights.items():
        if m := re.fullmatch(r"(.+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name):
            experts[m[1]][int(m[2]), role[m[3]]] = w
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = w
    for layer, ws in experts.items():
        n = len(ws) // 3
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([ws[e, 0], ws[e, 1]]) for e in range(n)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([ws[e, 2] for e in range(n)])
    return out


@pytest.mark.parametrize(
    "arch, per_expert_name, fused_ranks",
    [
        ("qwen3_moe", "model.layers.0.mlp.experts.7.gate_proj.weight", 2),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w1.weight", 1),
    ],
    ids=["qwen3-moe-fused-over-two-ranks", "mixtral-w1-w2-w3-over-two-ranks"],
)
def test_per_expert_and_fused_layouts_serve_alike(tmp_path, tokenizer, arch, per_expert_name, fused_ranks):
    from transformers import AutoModelForCausalLM

    per_expert = make_random_model(tmp_path / "per_expert", arch, tokenizer)
    weights = load_file(per_expert / "model.safetensors")
    assert per_expert_name in weights and not any(n.endswith("gate_up_proj") for n in weights)
    fused_weights = fused_layout(weights)
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32).state_dict()  # v5's own names
    assert hf.keys() == fused_weights.keys() and all(torch.equal(hf[n], w) for n, w in fused_weights.items())
    fused = resave(per_expert, tmp_path / "fused", fused_weights)
    one, two = (per_expert, fused) if fused_ranks == 2 else (fused, per_expert)
    ref = greedy(one)
    assert_same_greedy(greedy(two, tensor_parallel_size=2), ref, f"{arch}: {two.name} over two ranks")


def test_a_bf16_checkpoint_serves_as_hf_upcasts_it(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    base = make_random_model(tmp_path / "float32", "qwen3_moe", tokenizer)
    weights = {name: w.bfloat16() for name, w in load_file(base / "model.safetensors").items()}
    model_dir = resave(base, tmp_path / "bf16", weights, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert all(w.dtype == torch.float32 for w in hf.state_dict().values())
    llm = LLM(str(model_dir), **STRESS_ENGINE_ARGS)
    try:
        prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=12)
        deltas = run_and_compare(llm, hf, prompts, max_tokens, "qwen3-moe bf16 checkpoint", stop_at_eos=False)
        check_engine_exercised(llm, prompts, deltas)
    finally:
        llm.engine.shutdown()
