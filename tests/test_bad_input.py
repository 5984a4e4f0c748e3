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
        (dict(temperature=-0.1), "temperature must be non-negative"),
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
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


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
