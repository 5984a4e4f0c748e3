"""Gemma 4 beyond the exactness harness (``test_hf_equivalence.py -k gemma4``): which layers share whose
KV cache, the KV-cache sizing of layers of different shapes, the layout without the hybrid manager
(every layer its own tensor, global pages wider than sliding ones) against HF, and what is refused."""

from __future__ import annotations

import pytest
import torch
from exactness import make_prompts, run_and_compare
from models import STRESS_ENGINE_ARGS, make_random_model, tiny_config

from cb_serve import LLM
from cb_serve.attention.torch_backend import TorchAttentionBackend
from cb_serve.config.layer_configs import kv_widths
from cb_serve.distributed.sharding import shard_for
from cb_serve.engine.kv_cache_sizing import kv_cache_bytes_per_block
from cb_serve.kv_cache_interface import KVCacheLayout
from cb_serve.model_executor.models import model_class

VOCAB = 512


def test_kv_shared_layers_read_hf_s_store_layers():
    """Each shared layer reads the last earlier layer of its type: the layers HF marks ``store``."""
    config = tiny_config("gemma4_text", VOCAB)
    shared = model_class(config).kv_shared_layers(config)
    assert shared == {4: 2, 5: 3}
    modes = config.kv_sharing_modes
    assert {i for i, m in enumerate(modes) if m == "reuse"} == set(shared)
    assert {i for i, m in enumerate(modes) if m == "store"} == set(shared.values())
    pattern = ["sliding_attention"] * 4 + ["full_attention"]
    config = tiny_config("gemma4_text", VOCAB, num_hidden_layers=10, layer_types=pattern * 2, num_kv_shared_layers=4)
    assert model_class(config).kv_shared_layers(config) == {6: 5, 7: 5, 8: 5, 9: 4}
    specs = model_class(config).attention_specs(config)
    assert [s.kv_shared for s in specs] == [False] * 6 + [True] * 4
    assert [s.k_eq_v for s in specs] == [t == "full_attention" for t in pattern * 2]


def test_kv_cache_sizing_follows_each_layer():
    """Sliding pages (2 heads of 16) and global ones (1 head of 32) share tensors; a block holds a page
    of each tensor. Without k_eq_v the global layers keep 2 KV heads: pages twice as wide."""
    config = tiny_config("gemma4_text", VOCAB)
    windows = [s.sliding_window for s in model_class(config).attention_specs(config)]
    layout = KVCacheLayout.from_windows(windows, shared_from=model_class(config).kv_shared_layers(config))
    assert kv_widths(config) == [32] * 6 and layout.group_size == 2
    assert kv_cache_bytes_per_block(config, 16, torch.float32, layout) == 2 * 2 * 32 * 16 * 4
    wide = tiny_config("gemma4_text", VOCAB, attention_k_eq_v=False)
    assert kv_widths(wide) == [32, 64] * 3
    flat = KVCacheLayout.from_windows(windows, hybrid=False, shared_from={4: 2, 5: 3})
    assert kv_cache_bytes_per_block(wide, 16, torch.float32, flat) == 2 * (32 + 64 + 32 + 64) * 16 * 4


@pytest.mark.parametrize(
    "overrides,match",
    [({"use_bidirectional_attention": "all"}, "bidirectional")],  # (the MoE block is served: models.ARCHS)
)
def test_refused_features(overrides, match):
    config = tiny_config("gemma4_text", VOCAB, **overrides)
    with pytest.raises(ValueError, match=match):
        model_class(config)(config, TorchAttentionBackend(), torch.zeros(2, 8, 32), torch.zeros(2, 8, 32))


def test_tensor_parallelism_is_refused_clearly():
    """Its layers differ in KV heads: no rank split yet; one rank serves it."""
    config = tiny_config("gemma4_text", VOCAB)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported for gemma4_text"):
        shard_for(config, 0, 2)
    assert len(shard_for(config, 0, 1).q_heads) == 4


def test_pages_of_different_widths_without_the_hybrid_manager_match_hf(tmp_path, tokenizer):
    """Without ``attention_k_eq_v`` (a v projection on global layers, 2 KV heads of 32 against sliding
    layers' 2 of 16, as Gemma 4 E2B's differ): the hybrid layout would put both widths in one tensor and
    says so; with ``disable_hybrid_kv_cache_manager`` each layer owns a tensor (the shared layers their
    sources') and greedy outputs equal HF's under chunked prefill, preemption and prefix hits."""
    model_dir = make_random_model(tmp_path / "m", "gemma4_text", tokenizer, attention_k_eq_v=False)
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager"):
        LLM(str(model_dir), attention_backend="torch", **STRESS_ENGINE_ARGS)
    llm = LLM(str(model_dir), attention_backend="torch", disable_hybrid_kv_cache_manager=True, **STRESS_ENGINE_ARGS)
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=7)
    prompts, max_tokens = prompts[4:14], max_tokens[4:14]
    deltas = run_and_compare(llm, model_dir, prompts, max_tokens, "gemma4 without hybrid", stop_at_eos=False)
    assert deltas["num_partial_prefills"] > 0


def test_without_per_layer_inputs_or_kv_sharing_with_biases_matches_hf(tmp_path, tokenizer):
    """The optional parts off (per-layer inputs, KV-shared layers, double-wide MLP, soft-cap) and q/k/o
    biases on (V = K projection plus its bias on global layers), through the C++ kernels when built."""
    from cb_serve import cpu_ops

    overrides = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False)
    overrides.update(attention_bias=True, final_logit_softcapping=None)
    model_dir = make_random_model(tmp_path / "m", "gemma4_text", tokenizer, **overrides)
    llm = LLM(str(model_dir), attention_backend="cpu" if cpu_ops.available() else "torch", **STRESS_ENGINE_ARGS)
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=8)
    run_and_compare(llm, model_dir, prompts[4:10], max_tokens[4:10], "gemma4 plain", stop_at_eos=False)
