"""Phi-3's RoPE and window beyond the exactness harness (``models.ARCHS["phi3"]``): the LongRoPE
table choice per position, partial rotary in both RoPE paths, and a sliding window, against HF."""

from __future__ import annotations

import pytest
import torch
from models import ARCHS, assert_greedy_match, hf_greedy, hf_rotary, make_random_model, tiny_config

from cb_serve import LLM, SamplingParams, cpu_ops
from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.loader import model_rope_tables

ORIGINAL = 64  # original_max_position_embeddings of the configs here


def longrope_config():
    rope = {**ARCHS["phi3"][1]["rope_parameters"], "original_max_position_embeddings": ORIGINAL}
    return tiny_config("phi3", 32064, original_max_position_embeddings=ORIGINAL, rope_parameters=rope)


def test_longrope_tables_are_what_hf_uses_for_the_newest_token():
    """Position p's row is HF's rotary output when p is the newest token (a decode step): short
    factors below ``original_max_position_embeddings``, long ones from it on."""
    config = longrope_config()
    rotary, x = hf_rotary(config), torch.zeros(1)
    cos, sin = model_rope_tables(config, 128)
    assert cos.shape == sin.shape == (1, 128, 8)  # partial rotary: 8 of 16 dims
    for p in (0, 1, ORIGINAL - 1, ORIGINAL, 100, 127):
        hf_cos, hf_sin = rotary(x, torch.arange(p + 1)[None])  # a sequence of p + 1 tokens
        assert torch.equal(cos[0, p], hf_cos[0, p]) and torch.equal(sin[0, p], hf_sin[0, p]), p
    long_cos, _ = rotary(x, torch.arange(128)[None])
    assert not torch.allclose(cos[0, 1:ORIGINAL], long_cos[0, 1:ORIGINAL])  # the two factor sets differ


@pytest.mark.parametrize("use_cpu_ops", [False, True])
def test_partial_rotary_turns_only_the_rotary_dims_as_hf(use_cpu_ops):
    if use_cpu_ops and not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here")
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = longrope_config()
    cos, sin = model_rope_tables(config, 128)
    positions = torch.tensor([0, 3, 7, ORIGINAL, 100])
    torch.manual_seed(0)
    qk = torch.randn(len(positions), 6, 16)
    ours = Rope(positions, cos[0], sin[0], torch.float32, use_cpu_ops).apply(qk.clone())
    hf = qk.transpose(0, 1)[None]  # [batch, heads, tokens, head_dim]
    ref, _ = apply_rotary_pos_emb(hf, hf, cos[0][positions][None], sin[0][positions][None])
    torch.testing.assert_close(ours, ref[0].transpose(0, 1), rtol=0, atol=1e-6)
    assert torch.equal(ours[..., 8:], qk[..., 8:])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_sliding_window_matches_hf(backend, tmp_path, tokenizer):
    """HF 5.x masks every Phi-3 layer with ``sliding_window`` when the config sets one (as Mistral)."""
    if backend == "cpu" and not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here")
    model_dir = make_random_model(tmp_path, "phi3", tokenizer, sliding_window=24)
    llm = LLM(str(model_dir), attention_backend=backend, max_model_len=256, num_gpu_blocks=64)
    prompts, max_tokens = [list(range(200, 200 + n)) for n in (5, 30, 90)], [12, 20, 16]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, (ref, ref_logits)) in enumerate(zip(outs, hf_greedy(model_dir, prompts, max_tokens))):
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits, f"phi3 window prompt {i}")
