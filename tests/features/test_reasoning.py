"""Reasoning output (vLLM's reasoning parsers) and chat-template options.

Parsers: streaming any split of a text (tags cut across chunks included) gives what the whole text
gives; deepseek_r1 and qwen3 cases; the token-level end of the reasoning. Engine (the scripted model
of ``scripted_model.py``): with a reasoning parser a structured output's grammar applies after
``</think>`` (masks, jump-forward, drafts), without one from the first token. Chat templates:
``chat_template_kwargs``, ``continue_final_message``, ``reasoning_effort``, a request's template.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
from scripted_model import CONTENT, SCRIPT, THINK_END, THINK_START, make_scripted_model

from cb_serve import LLM, InvalidRequestError, SamplingParams
from cb_serve.chat_template import PromptEncoder, apply_chat_template, check_template_kwargs, thinking_kwargs
from cb_serve.config.engine import REASONING_PARSERS
from cb_serve.reasoning import PARSERS, ReasoningParser, reasoning_parser
from cb_serve.spec_decode.proposer import DraftProposer
from cb_serve.structured_outputs import StructuredOutputsParams

START, END = 7, 8  # the think tokens' ids in the fake vocabulary


class ThinkVocab:
    def get_vocab(self) -> dict[str, int]:
        return {"a": 1, "b": 2, THINK_START: START, THINK_END: END}


PARSER_NAMES = sorted(name for name, cls in PARSERS.items() if cls.tags_are_tokens)  # Granite's are text
OPEN, CLOSED, NO_TAG = [1, START, 2], [1, START, 2, END, 2], [1, 2]  # prompts: where they leave off


def parser(name: str) -> ReasoningParser:
    return reasoning_parser(name, ThinkVocab())


def streamed(p: ReasoningParser, prompt: list[int], chunks: list[str]) -> tuple[str | None, str | None]:
    splitter, reasoning, content = p.splitter(prompt), "", ""
    for chunk in chunks:
        r, c = splitter.feed(chunk)
        assert not (c and splitter.in_reasoning), "content streamed while still reasoning"
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return (reasoning + r) or None, (content + c) or None


TEXTS = [
    "abc</think>xyz",
    "<think>\nabc\n</think>\n\nxyz",
    "<think>ab<think>c</think>x</think><think>y",
    "plain text, no tags </thin",
    "a<</think><thi",
    "</think>",
    "<think></think>",
    "x<think",
]


@pytest.mark.parametrize("name", PARSER_NAMES)
@pytest.mark.parametrize("prompt", [OPEN, CLOSED, NO_TAG], ids=["open", "closed", "no_tag"])
def test_every_split_streams_what_the_whole_text_gives(name, prompt):
    p = parser(name)
    for text in TEXTS:
        whole = p.split(text, prompt)
        assert streamed(p, prompt, list(text)) == whole, text  # one character at a time
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                assert streamed(p, prompt, [text[:i], text[i:j], text[j:]]) == whole, (text, i, j)


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_a_tag_cut_across_chunks_is_held_back_never_leaked(name):
    splitter = parser(name).splitter(OPEN)
    assert splitter.feed("Let me think</th") == ("Let me think", "")
    assert splitter.feed("ink>The") == ("", "The")
    assert splitter.feed(" answer</think>") == ("", " answer</think>")  # content: verbatim
    splitter = parser(name).splitter(OPEN)
    assert splitter.feed("cut off at </thi") == ("cut off at ", "")
    assert splitter.finish() == ("</thi", "")  # the output ended: an unfinished tag is text


@pytest.mark.parametrize(
    "name, prompt, text, expected",
    [
        # R1's template opens the block in the prompt: text before </think> is reasoning
        ("deepseek_r1", OPEN, "abc</think>xyz", ("abc", "xyz")),
        ("deepseek_r1", OPEN, "<think>abc</think>xyz", ("abc", "xyz")),  # an emitted <think> is dropped
        ("deepseek_r1", OPEN, "still thinking", ("still thinking", None)),  # cut by max_tokens
        ("deepseek_r1", NO_TAG, "abc</think>xyz", ("abc", "xyz")),  # R1 always reasons first
        ("deepseek_r1", OPEN, "</think>xyz", (None, "xyz")),
        ("deepseek_r1", CLOSED, "abc</think>xyz", (None, "abc</think>xyz")),  # the prompt ended it
        # Qwen3 (first templates): the model writes <think> itself
        ("qwen3", NO_TAG, "<think>\nabc\n</think>\n\nxyz", ("\nabc\n", "\n\nxyz")),
        # Qwen3-Thinking-2507 / Qwen3.5: <think> in the prompt, only </think> in the output
        ("qwen3", OPEN, "abc</think>xyz", ("abc", "xyz")),
        ("qwen3", OPEN, "abc</think>", ("abc", None)),
        ("qwen3", NO_TAG, "<think>truncated", ("truncated", None)),
        # enable_thinking=false: the template's empty block closed it, the output is content
        ("qwen3", CLOSED, "The answer.", (None, "The answer.")),
        ("qwen3", CLOSED, "<think>x</think>y", (None, "<think>x</think>y")),
        ("qwen3", [START, 1, END, 2, START], "abc</think>xyz", ("abc", "xyz")),  # an earlier closed block
    ],
)
def test_parser_cases(name, prompt, text, expected):
    assert parser(name).split(text, prompt) == expected


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_token_level_end_of_reasoning(name):
    p = parser(name)
    assert (p.think_start_id, p.think_end_id) == (START, END)
    assert not p.reasoning_ended(OPEN, []) and not p.reasoning_ended(NO_TAG, [1, 2])  # no tag yet: reasoning
    assert p.reasoning_ended(CLOSED, []) and p.reasoning_ended(CLOSED, [1])  # enable_thinking=false
    assert p.reasoning_ended(OPEN, [1, END]) and p.reasoning_ended(NO_TAG, [START, 1, END, 2])
    assert not p.reasoning_ended(NO_TAG, [START, 1])
    assert not p.reasoning_ended(CLOSED, [START])  # the last tag decides
    assert not p.reasoning_ended([START, 1, END, 2, START], [1])  # a new block after a closed one
    assert not p.starts_in_reasoning(CLOSED) and p.starts_in_reasoning(OPEN) and p.starts_in_reasoning(NO_TAG)


def test_factory_names_and_a_tokenizer_without_think_tokens(tokenizer, random_model_dir):
    assert sorted(REASONING_PARSERS) == sorted(PARSERS)
    with pytest.raises(ValueError, match="Unknown reasoning_parser"):
        reasoning_parser("nope", ThinkVocab())
    with pytest.raises(ValueError, match="no <think> and </think> token"):
        reasoning_parser("qwen3", tokenizer)  # SmolLM2's
    with pytest.raises(ValueError, match="not a reasoning model"):  # at engine start, before the weights load
        LLM(str(random_model_dir("llama")), reasoning_parser="deepseek_r1")


# ---- the engine: the scripted model --------------------------------------------------------------------
ENGINE = dict(max_model_len=256, num_gpu_blocks=64)
USER = [{"role": "user", "content": "What is 2 + 2?"}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
YES_NO = StructuredOutputsParams(regex="(yes|no)")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("scripted")
    return str(directory), make_scripted_model(directory, tokenizer)


@pytest.fixture(scope="module")
def thinking_llm(scripted):
    return LLM(scripted[0], reasoning_parser="qwen3", **ENGINE)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, **kwargs)


def test_the_scripted_model_says_its_script(scripted, thinking_llm):
    from models import hf_greedy

    directory, script_ids = scripted
    prompt = thinking_llm.apply_chat_template(USER)
    assert hf_greedy(directory, [prompt], [40], stop_at_eos=True)[0][0] == script_ids
    out = thinking_llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == script_ids and out.text == SCRIPT
    off = apply_chat_template(thinking_llm.engine.tokenizer, USER, chat_template_kwargs={"enable_thinking": False})
    assert thinking_llm.generate([off], greedy(), use_tqdm=False)[0].outputs[0].text == CONTENT
    chat = thinking_llm.chat(USER, greedy(), use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert chat[0].outputs[0].text == CONTENT  # LLM.chat takes vLLM's template options


def split(llm: LLM, prompt: list[int], text: str) -> tuple[str | None, str | None]:
    return llm.engine.structured.reasoning.split(text, prompt)


def test_the_grammar_applies_after_the_reasoning(thinking_llm):
    prompt = thinking_llm.apply_chat_template(USER)
    schema = greedy(structured_outputs=StructuredOutputsParams(json=ANSWER))
    text = thinking_llm.generate([prompt], schema, use_tqdm=False)[0].outputs[0].text
    assert text == SCRIPT  # <think> (which JSON refuses) came out: the reasoning went unmasked
    reasoning, content = split(thinking_llm, prompt, text)
    assert reasoning == "Let me think" and json.loads(content) == {"answer": 4}
    text = thinking_llm.generate([prompt], greedy(structured_outputs=YES_NO), use_tqdm=False)[0].outputs[0].text
    assert split(thinking_llm, prompt, text)[0] == "Let me think"
    assert split(thinking_llm, prompt, text)[1] in ("yes", "no")  # the script's JSON refused after </think>


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_first_token(thinking_llm):
    prompt = apply_chat_template(thinking_llm.engine.tokenizer, USER, chat_template_kwargs={"enable_thinking": False})
    text = thinking_llm.generate([prompt], greedy(structured_outputs=YES_NO), use_tqdm=False)[0].outputs[0].text
    assert text in ("yes", "no") and split(thinking_llm, prompt, text) == (None, text)


def test_without_a_reasoning_parser_the_grammar_applies_from_the_first_token(scripted):
    llm = LLM(scripted[0], **ENGINE)
    assert llm.engine.structured.reasoning is None
    text = llm.generate([llm.apply_chat_template(USER)], greedy(structured_outputs=YES_NO), use_tqdm=False)
    assert text[0].outputs[0].text in ("yes", "no")


def test_jump_forward_starts_after_the_reasoning(scripted):
    llm = LLM(scripted[0], reasoning_parser="qwen3", enable_jump_forward=True, **ENGINE)
    params = greedy(structured_outputs=StructuredOutputsParams(regex="answer: (yes|no)"))
    text = llm.generate([llm.apply_chat_template(USER)], params, use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch(r"<think>Let me think</think>answer: (yes|no)", text), text
    assert llm.engine.jump_forward_tokens >= 2  # "answer:" was forced, after </think>


class ScriptProposer(DraftProposer):
    """Drafts the script from where each sequence is: runs that cross </think> are proposed."""

    def __init__(self, script_ids: list[int]) -> None:
        self.script_ids = script_ids

    def propose(self, seqs, num_drafts):
        return [self.script_ids[s.num_output_tokens :][:k] for s, k in zip(seqs, num_drafts)]


def test_drafts_stop_before_the_end_of_the_reasoning(scripted):
    directory, script_ids = scripted
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "adaptive": False}
    llm = LLM(directory, reasoning_parser="qwen3", speculative_config=spec, **ENGINE)
    llm.engine.speculator.proposer = ScriptProposer(script_ids)
    prompt = llm.apply_chat_template(USER)
    text = llm.generate([prompt], greedy(structured_outputs=YES_NO), use_tqdm=False)[0].outputs[0].text
    assert split(llm, prompt, text)[0] == "Let me think" and split(llm, prompt, text)[1] in ("yes", "no")
    assert llm.engine.speculator.counters.num_accepted_tokens >= 3  # "Let me think", then </think> sampled
    structured, end = llm.engine.structured, script_ids.index(llm.engine.structured.reasoning.think_end_id)
    seq = reasoning_seq(structured, prompt=[1, 2], output=[])
    assert structured.valid_drafts(seq, script_ids[1:]) == script_ids[1:end]  # up to </think>, not past it


def reasoning_seq(structured, prompt: list[int], output: list[int]):
    """A sequence still reasoning, held by ``structured`` (its matcher not yet applied)."""
    tokens = prompt + output
    seq = type("Seq", (), {"matcher": None, "token_ids": tokens, "num_prompt_tokens": len(prompt)})()
    seq.num_tokens = len(tokens)
    structured._reasoning_seqs[seq] = object()
    return seq


def test_drafts_stop_before_an_end_marker_of_several_tokens(tokenizer):
    """Harmony's reasoning ends at a header of three tokens: drafts stop before the one that completes it,
    also when the output (or the prompt's end) already holds its first tokens; a marker wholly in the prompt
    is the prompt's (``starts_in_reasoning`` decides)."""
    from cb_serve.structured_outputs.manager import StructuredOutputManager

    end = type("End", (), {"end_ids": (7, 8, 9), "starts_in_reasoning": lambda self, prompt: True})()
    structured = StructuredOutputManager(tokenizer, len(tokenizer), reasoning=end)
    assert structured.valid_drafts(reasoning_seq(structured, [7, 8], []), [5, 7, 8, 9, 6]) == [5, 7, 8]
    assert structured.valid_drafts(reasoning_seq(structured, [1], [7, 8]), [9, 6]) == []
    assert structured.valid_drafts(reasoning_seq(structured, [1, 7], [8]), [9, 6]) == []  # begun in the prompt
    assert structured.valid_drafts(reasoning_seq(structured, [7, 8, 9], []), [7, 8, 9]) == [7, 8]
    assert structured.valid_drafts(reasoning_seq(structured, [1], [3]), [7, 8, 3, 9]) == [7, 8, 3, 9]


def test_min_tokens_bans_eos_while_reasoning(thinking_llm):
    eos = thinking_llm.engine.tokenizer.eos_token_id
    prompt = [*thinking_llm.apply_chat_template(USER), *thinking_llm.engine.tokenizer.encode("}")]  # next: EOS
    outs = thinking_llm.generate(
        [prompt] * 2, [greedy(structured_outputs=YES_NO, min_tokens=m) for m in (0, 3)], use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == [eos]  # still reasoning: EOS ends it, the grammar never began
    assert eos not in outs[1].outputs[0].token_ids[:3]  # banned as for an unconstrained request


# ---- chat-template options ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def think_tokenizer(thinking_llm):
    return thinking_llm.engine.tokenizer


def test_chat_template_kwargs_reach_the_template(think_tokenizer):
    tok = think_tokenizer
    on = apply_chat_template(tok, USER)
    off = apply_chat_template(tok, USER, chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(on).endswith("<|im_start|>assistant\n")
    assert off[: len(on)] == on and tok.decode(off[len(on) :]) == "<think>\n\n</think>\n\n"
    assert apply_chat_template(tok, USER, chat_template_kwargs={"enable_thinking": True}) == on


def test_continue_final_message_leaves_the_last_message_open(think_tokenizer, thinking_llm):
    tok, started = think_tokenizer, [*USER, {"role": "assistant", "content": "<think>Let me"}]
    prompt = apply_chat_template(tok, started, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>Let me")
    text = thinking_llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].text
    assert text == f" think</think>{CONTENT}" and split(thinking_llm, prompt, text) == (" think", CONTENT)
    for messages, add in ((started, True), (USER, False)):  # with a generation prompt; no assistant last
        with pytest.raises(InvalidRequestError) as e:
            apply_chat_template(tok, messages, add_generation_prompt=add, continue_final_message=True)
        assert e.value.param == "continue_final_message"


def test_reasoning_effort_maps_to_the_templates_switch(think_tokenizer, tokenizer):
    tok = think_tokenizer
    assert [thinking_kwargs(tok, e)["enable_thinking"] for e in ("none", "minimal", "low", "medium", "high")] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert thinking_kwargs(tok, None) == {}
    effort_template = "{{ messages[0].content }}{% if reasoning_effort == 'high' %} (think hard){% endif %}"
    assert thinking_kwargs(tok, "high", effort_template) == {"reasoning_effort": "high"}
    rendered = apply_chat_template(tok, USER, chat_template=effort_template, reasoning_effort="high")
    assert tok.decode(rendered) == "What is 2 + 2? (think hard)"
    off = apply_chat_template(tok, USER, chat_template_kwargs={"enable_thinking": False})
    assert apply_chat_template(tok, USER, reasoning_effort="none") == off
    bad = [
        (tokenizer, "high", {}),  # SmolLM2's template has no thinking switch: a 400
        (tok, "extreme", {}),
        (tok, "none", {"enable_thinking": True}),  # a conflict
    ]
    for t, effort, kwargs in bad:
        with pytest.raises(InvalidRequestError) as e:
            apply_chat_template(t, USER, reasoning_effort=effort, chat_template_kwargs=kwargs)
        assert e.value.param == "reasoning_effort"


@pytest.mark.parametrize(
    "kwargs",
    [
        ["enable_thinking"],
        {1: True},
        {"tokenize": False},
        {"add_generation_prompt": False},
        {"messages": []},
        {"chat_template": "{{ 1 }}"},
        {"continue_final_message": True},
        {"tools": []},
        {"x": object()},
        {"x": {"nested": {1, 2}}},
        {"x": [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]},  # deeper than MAX_KWARGS_DEPTH
    ],
)
def test_bad_template_kwargs_are_refused(kwargs):
    with pytest.raises(InvalidRequestError) as e:
        check_template_kwargs(kwargs)
    assert e.value.param == "chat_template_kwargs"


def test_a_requests_chat_template(think_tokenizer):
    bare = copy.copy(think_tokenizer)
    bare.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        apply_chat_template(bare, USER)
    ids = apply_chat_template(bare, USER, chat_template="Q: {{ messages[-1].content }} A:")
    assert think_tokenizer.decode(ids) == "Q: What is 2 + 2? A:"
    with pytest.raises(InvalidRequestError) as e:
        apply_chat_template(think_tokenizer, USER, chat_template="{% for %}")
    assert e.value.param == "chat_template"
    assert check_template_kwargs({"enable_thinking": False, "x": [1, "a", None, {"k": 2.5}]})["x"][3] == {"k": 2.5}


def test_prompt_encoder_takes_the_options(scripted, think_tokenizer):
    from cb_serve.config import EngineConfig

    encoder = PromptEncoder(EngineConfig(model=scripted[0]))
    options = dict(chat_template_kwargs={"enable_thinking": False})
    assert encoder.encode_chat(USER, **options) == apply_chat_template(think_tokenizer, USER, **options)
    assert encoder.encode_chat(USER, reasoning_effort="low") == apply_chat_template(think_tokenizer, USER)
