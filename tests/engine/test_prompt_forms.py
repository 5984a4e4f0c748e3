"""vLLM's prompt forms (issue 16): a string, a list of token ids, ``{"prompt": ...}``
(TextPrompt), ``{"prompt_token_ids": [...]}`` (TokensPrompt), and lists of any of them, through
``LLM.generate`` and ``AsyncLLM.generate``, plus ``EngineStats``' request counts (vLLM counts
requests where we used to count sequences).

Mirrored from vLLM's ``tests/entrypoints/llm/test_generate.py`` (multiple sampling params) and
``test_prompt_validation.py`` (empty prompt, out-of-vocabulary token in a TokensPrompt), as far
as they apply: vLLM's ``test_max_model_len`` expects max_tokens past the context to be cut
short, while this engine refuses such a request (as vLLM's OpenAI server does), so it is not
ported."""

from __future__ import annotations

import asyncio

import pytest

from cb_serve import AsyncLLM, EngineConfig, SamplingParams, TextPrompt, TokensPrompt

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
TOKEN_IDS = [[0], [0, 1], [0, 2, 1], [0, 3, 1, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def ids_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_every_prompt_form_gives_what_its_token_ids_give(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    reference = ids_of(tiny_llm.generate(encoded, GREEDY, use_tqdm=False))
    forms = {
        "strings": PROMPTS,
        "TextPrompt": [TextPrompt(prompt=p) for p in PROMPTS],
        "TokensPrompt": [TokensPrompt(prompt_token_ids=ids) for ids in encoded],
        "mixed": [PROMPTS[0], {"prompt": PROMPTS[1]}, {"prompt_token_ids": encoded[2]}],
    }
    for name, prompts in forms.items():
        assert ids_of(tiny_llm.generate(prompts, GREEDY, use_tqdm=False)) == reference, name


def test_a_single_prompt_of_each_form_is_one_request(tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[0])
    for prompt in (PROMPTS[0], ids, {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}):
        (out,) = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == ids
    assert tiny_llm.generate([], GREEDY, use_tqdm=False) == []


def test_tokens_prompt_keeps_its_text_and_token_id_lists_stay_in_order(tiny_llm):
    (out,) = tiny_llm.generate({"prompt_token_ids": [5, 6, 7], "prompt": "five six seven"}, GREEDY, use_tqdm=False)
    assert out.prompt == "five six seven" and out.prompt_token_ids == [5, 6, 7]
    outs = tiny_llm.generate([{"prompt_token_ids": ids} for ids in TOKEN_IDS], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == TOKEN_IDS


def test_multiple_sampling_params(tiny_llm):
    params = [SamplingParams(temperature=t, top_p=0.95, max_tokens=4) for t in (0.01, 0.3, 0.7)]
    prompts = [{"prompt": p} for p in PROMPTS]
    assert len(tiny_llm.generate(prompts, params, use_tqdm=False)) == len(prompts)
    with pytest.raises(ValueError, match="3 prompts but 2 sampling params"):
        tiny_llm.generate(prompts, params[:2], use_tqdm=False)
    assert len(tiny_llm.generate(prompts, SamplingParams(temperature=0.3, max_tokens=4), use_tqdm=False)) == 3


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ("", ValueError, "prompt is empty"),
        ({"prompt": ""}, ValueError, "prompt is empty"),
        ({"prompt_token_ids": []}, ValueError, "prompt is empty"),
        ({"prompt_token_ids": [999999]}, ValueError, "out of vocabulary"),
        ({"prompt_token_ids": [1.5]}, ValueError, "must be integers"),
        ({"prompt_token_ids": "1 2 3"}, TypeError, "list of token ids"),
        ({"prompt": 7}, TypeError, "is a string"),
        ({}, ValueError, "needs"),
        ({"prompt": "x", "prompt_embeds": []}, ValueError, "unsupported fields"),
        ({"prompt": "x", "multi_modal_data": {}}, ValueError, "images only"),
        ({"prompt": "x", "priority": 1}, ValueError, "unknown fields"),
        (3.5, TypeError, "TokensPrompt"),
    ],
)
def test_bad_prompts_are_refused_before_anything_runs(tiny_llm, prompt, error, match):
    with pytest.raises(error, match=match):
        tiny_llm.generate([PROMPTS[0], prompt], GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_async_llm_takes_the_same_forms(random_model_dir, tiny_llm):
    engine = AsyncLLM(EngineConfig(model=str(random_model_dir("llama")), max_model_len=512, num_gpu_blocks=128))
    ids = tiny_llm.get_tokenizer().encode(PROMPTS[2])
    (reference,) = ids_of(tiny_llm.generate(PROMPTS[2], GREEDY, use_tqdm=False))

    async def tokens(prompt, request_id: str) -> list[int]:
        async for o in engine.generate(prompt, GREEDY, request_id):  # cumulative outputs: keep the last
            last = o
        return last.outputs[0].token_ids

    async def main():
        forms = [PROMPTS[2], ids, TextPrompt(prompt=PROMPTS[2]), TokensPrompt(prompt_token_ids=ids)]
        return await asyncio.gather(*(tokens(p, f"r{i}") for i, p in enumerate(forms)))

    try:
        assert asyncio.run(main()) == [reference] * 4
        with pytest.raises(ValueError, match="out of vocabulary"):
            asyncio.run(tokens({"prompt_token_ids": [10**9]}, "bad"))
        engine.check_health()
    finally:
        engine.shutdown()


def test_engine_stats_count_requests_as_vllm_does(tiny_llm):
    """A request with n = 3 runs three sequences: one running request, three running sequences."""
    engine = tiny_llm.engine
    engine.add_request("n3", "a b c", SamplingParams(n=3, max_tokens=8, temperature=1.0))
    engine.add_request("n1", "d e f", SamplingParams(max_tokens=8))
    engine.step()
    stats = engine.get_stats()
    assert (stats.num_requests_running, stats.num_running) == (2, 4)
    assert (stats.num_requests_waiting, stats.num_waiting) == (0, 0)
    engine.abort_request(["n3", "n1"])
    assert engine.get_stats().num_requests_running == 0
