"""Acceptance 5: bad input is rejected with a clear ValueError before anything is
scheduled, and nothing leaks."""

from __future__ import annotations

import json

import pytest

from cb_serve import LLM, SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(max_tokens=-5), "max_tokens must be at least 1"),
        (dict(temperature=-0.1), "temperature must be a non-negative number"),
        (dict(temperature=float("nan")), "temperature must be a non-negative number"),
        (dict(temperature=float("inf")), "temperature must be a non-negative number"),
        (dict(seed=2**64), "seed must be an integer in"),
        (dict(seed=-(2**63) - 1), "seed must be an integer in"),
        (dict(top_k=True), "top_k must be -1"),
        (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be -1"),
        (dict(n=0), "n must be at least 1"),
        (dict(min_p=2.0), "min_p must be in"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs must be"),
        (dict(stop=[""]), "stop strings must be non-empty"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs)), "the error names the parameter"


def test_edge_values_the_engine_holds(tiny_llm: LLM):
    """Values at the edges are accepted and mean what vLLM makes them mean: a temperature below
    1e-5 is greedy (1e-40 used to give NaN probabilities), a top_k beyond the vocabulary is off,
    the largest and smallest seeds seed a generator."""
    greedy = tiny_llm.generate(["edge"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tiny = SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True)
    assert tiny.temperature == 0.0
    assert tiny_llm.generate(["edge"], tiny, use_tqdm=False)[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    for params in (
        SamplingParams(top_k=2**63, max_tokens=3, seed=2**64 - 1, n=3),
        SamplingParams(top_k=10**30, max_tokens=3, seed=-(2**63)),
    ):
        out = tiny_llm.generate(["edge"], params, use_tqdm=False)[0]
        assert all(len(c.token_ids) == 3 and c.finish_reason == "length" for c in out.outputs)
    assert tiny_llm.engine.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize(
    "params, param",
    [
        (SamplingParams(stop=["x"] * 65), "stop"),
        (SamplingParams(stop=["y" * 513]), "stop"),
        (SamplingParams(stop_token_ids=list(range(257))), "stop_token_ids"),
        (SamplingParams(logprobs=21), "logprobs"),
    ],
)
def test_engine_caps_name_the_parameter(tiny_llm: LLM, params, param):
    """The engine's configurable caps (max_stop_strings 64, max_stop_string_len 512,
    max_stop_token_ids 256, max_logprobs 20 by default) refuse a request before it is queued."""
    with pytest.raises(ValueError) as info:
        tiny_llm.generate(["capped"], params, use_tqdm=False)
    assert info.value.param == param
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([1, 2, -1], SamplingParams(), "out of vocabulary"),
        ([10**7], SamplingParams(), "out of vocabulary"),
        (["a", "b"], SamplingParams(), "must be integers"),
        ([5] * 600, SamplingParams(max_tokens=1), "maximum context length"),
        ([5] * 500, SamplingParams(max_tokens=20), "maximum context length"),
        ("hello", SamplingParams(max_tokens=513), "maximum context length"),
        ("hello", SamplingParams(stop_token_ids=[10**7]), "out of vocabulary"),
    ],
)
def test_bad_requests_rejected_before_scheduling(tiny_llm: LLM, prompt, params, message):
    engine = tiny_llm.engine
    with pytest.raises(ValueError, match=message):
        tiny_llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests(), "a rejected batch must queue nothing"
    assert engine.get_stats().kv_blocks_used == 0
    assert tiny_llm.generate(["still works"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model="/nonexistent/model-dir")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model="./missing.gguf")


def test_unknown_hub_id_fails_clearly():
    with pytest.raises(ValueError, match="Could not load model"):
        LLM(model="no-such-org/no-such-model-xyz")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="Unsupported architecture 'gpt2'"):
        LLM(model=str(tmp_path))


def test_bad_engine_args(random_model_dir):
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        LLM(str(random_model_dir("llama")), max_num_seqs=0)
    with pytest.raises(TypeError, match="Unknown engine argument"):
        LLM(str(random_model_dir("llama")), max_num_seq=4)
    with pytest.raises(ValueError, match="fewer than one max_model_len"):
        LLM(str(random_model_dir("llama")), num_gpu_blocks=2, max_model_len=512)
