"""Greedy outputs equal HF transformers ``model.generate`` token for token, through the shared
exactness harness (``exactness.py``): every tiny architecture of ``models.ARCHS`` under both
attention backends, and the real SmolLM2 with each scheduling feature on and off."""

from __future__ import annotations

import random

import pytest
from exactness import check_engine_exercised, make_prompts, run_and_compare
from models import ARCHS, STRESS_ENGINE_ARGS, hf_greedy, stress_engine_args

from cb_serve import LLM, cpu_ops


@pytest.fixture(scope="module")
def random_model_refs() -> dict:
    """HF's greedy outputs for the last architecture's prompts: both backends of an architecture (run one
    after the other) compare against the same model, prompts and lengths, so HF computes them once. One
    entry at a time: each holds every step's logits."""
    return {}


@pytest.mark.parametrize("backend", ["torch", "cpu"])  # the PyTorch reference and the C++ kernels
@pytest.mark.parametrize("arch", list(ARCHS))
def test_random_models_match_hf(arch, backend, random_model_dir, random_model_refs):
    if backend == "cpu" and not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here (no C++ toolchain?)")
    model_dir = random_model_dir(arch)
    llm = LLM(str(model_dir), attention_backend=backend, **stress_engine_args(arch))
    assert llm.engine.backend.name == backend
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=list(ARCHS).index(arch))
    if arch not in random_model_refs:
        random_model_refs.clear()
        random_model_refs[arch] = hf_greedy(model_dir, prompts, max_tokens, stop_at_eos=False)
    ref = random_model_refs[arch]
    deltas = run_and_compare(llm, model_dir, prompts, max_tokens, arch, stop_at_eos=False, ref=ref)
    check_engine_exercised(llm, prompts, deltas)


@pytest.fixture(scope="module")
def smol_workload(smol_hf, tokenizer):
    """Prompts of real text, their lengths, and HF's greedy outputs (computed once)."""
    import pathlib

    text = pathlib.Path(__file__).read_text() + pathlib.Path(random.__file__).read_text()[:60000]
    prompts, max_tokens = make_prompts(tokenizer.encode(text), seed=1)
    return prompts, max_tokens, hf_greedy(smol_hf, prompts, max_tokens, stop_at_eos=True)


def test_smollm2_matches_hf(smol_llm, smol_hf, smol_workload):
    prompts, max_tokens, ref = smol_workload
    deltas = run_and_compare(smol_llm, smol_hf, prompts, max_tokens, "smollm2", stop_at_eos=True, ref=ref)
    check_engine_exercised(smol_llm, prompts, deltas)


@pytest.mark.parametrize("feature", ["enable_prefix_caching", "enable_chunked_prefill"])
def test_smollm2_matches_hf_with_a_feature_off(feature, smol_hf, smol_workload):
    """README: prefix caching and chunked prefill can each be turned off; outputs stay HF's."""
    args = {**STRESS_ENGINE_ARGS, feature: False}
    if feature == "enable_chunked_prefill":  # without chunks a whole (re)computed sequence must fit one step
        args["max_num_batched_tokens"] = args["max_model_len"]
    llm = LLM(**args)
    prompts, max_tokens, ref = smol_workload
    deltas = run_and_compare(llm, smol_hf, prompts, max_tokens, f"smollm2 without {feature}", True, ref=ref)
    if feature == "enable_prefix_caching":  # recomputation after preemption finds nothing cached either
        assert deltas["prefix_cache_hits"] == 0 and deltas["num_partial_prefills"] > 0
        assert deltas["num_preemptions"] > 0, "no sequence was preempted"
    else:
        assert deltas["num_partial_prefills"] == 0 and deltas["prefix_cache_hits"] > 0
