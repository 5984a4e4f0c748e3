"""gpt-oss's Harmony format (issue 52): the output's channels split into reasoning (``analysis``), content
(``final``, preambles) and tool calls (``commentary`` to ``functions.NAME``), as it streams, against the real
gpt-oss chat template (a fixture naming its source): what the template writes for a turn parses back whole and
streamed at every split; text that is no Harmony stays content; ``reasoning_effort`` reaches the template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cb_serve import HarmonySplitter, HarmonyToolParser, tool_call_parser_for_template
from cb_serve.chat_template import thinking_kwargs
from cb_serve.serve.engine_chunk import EngineChunk
from cb_serve.serve.responses import Choice

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "gpt_oss.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
THINK = "The user wants the weather. I should call get_weather."


def rendered_turn(tokenizer, assistant: dict) -> str:
    """What gpt-oss writes for ``assistant``: its turn as the real template renders it, without the
    ``<|start|>assistant`` the generation prompt already holds and the stop token that ends it."""
    messages = [{"role": "user", "content": "Weather in Paris?"}, assistant]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], chat_template=TEMPLATE, tokenize=False)
    turn = text.split("Weather in Paris?<|end|>", 1)[1]
    assert turn.startswith("<|start|>assistant") and turn.endswith(("<|call|>", "<|return|>")), turn
    return turn.removeprefix("<|start|>assistant").removesuffix("<|call|>").removesuffix("<|return|>")


def run(text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, dict]]]:
    """(reasoning, content, calls) of ``text`` fed in pieces cut at ``cuts``, through the splitter then the
    tool-call parser (as the HTTP layer chains them)."""
    splitter, parser = HarmonySplitter(), HarmonyToolParser([WEATHER])
    reasoning, content = "", ""
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        r, c = splitter.feed(text[a:b])
        reasoning, content = reasoning + r, content + parser.feed(c)[0]
    r, c = splitter.finish()
    reasoning, content = reasoning + r, content + parser.feed(c)[0] + parser.finish()
    return reasoning, content, [(call.name, json.loads(call.arguments)) for call in parser.calls]


def test_the_template_is_read_as_harmony_and_reasoning_effort_reaches_it(tokenizer):
    assert tool_call_parser_for_template(TEMPLATE) == "openai"
    kwargs = thinking_kwargs(tokenizer, "high", TEMPLATE)
    assert kwargs == {"reasoning_effort": "high"}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True,
        **kwargs,
    )  # fmt: skip
    assert "Reasoning: high" in prompt and prompt.endswith("<|start|>assistant")


def test_a_tool_call_turn_parses_back_whole_and_streamed(tokenizer):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = rendered_turn(tokenizer, {"role": "assistant", "thinking": THINK, "tool_calls": [call]})
    assert "<|channel|>analysis<|message|>" in turn and "to=functions.get_weather" in turn
    want = (THINK, "", [("get_weather", {"city": "Paris"})])
    assert run(turn, []) == want
    for cut in range(1, len(turn)):
        assert run(turn, [cut]) == want, cut
    assert run(turn, list(range(1, len(turn)))) == want  # a character at a time


def test_a_final_answer_turn_splits_reasoning_from_content(tokenizer):
    turn = rendered_turn(tokenizer, {"role": "assistant", "thinking": THINK, "content": "It is sunny in Paris."})
    want = (THINK, "It is sunny in Paris.", [])
    for cut in range(0, len(turn), 2):
        assert run(turn, [cut] if cut else []) == want
    assert HarmonySplitter().split(turn) == (THINK, "It is sunny in Paris.")
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    assert run(preamble, []) == ("", "Checking.Done.", [])  # a preamble (no recipient) is for the user


def test_text_that_is_no_harmony_and_malformed_calls_stay_text():
    assert run("Hello there.", [3]) == ("", "Hello there.", [])
    cut = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par'
    reasoning, content, calls = run(cut, [20])
    assert reasoning == "" and not calls and content.endswith('{"city": "Par<|call|>')


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_the_http_choice_carries_reasoning_content_and_calls(tokenizer, include_reasoning):
    from cb_serve.serve.choice_assembler import DroppedReasoning

    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    turn = rendered_turn(tokenizer, {"role": "assistant", "thinking": THINK, "tool_calls": [call]})
    pieces = [turn[i : i + 5] for i in range(0, len(turn), 5)]
    chunks = [
        EngineChunk(0, p, 1, None, "stop" if i == len(pieces) - 1 else None, None, 5, 0, None, "replica")
        for i, p in enumerate(pieces)
    ]
    splitter = HarmonySplitter() if include_reasoning else DroppedReasoning(HarmonySplitter())
    choice = Choice(0, chat=True, tools=True, reasoning=splitter, tool_parser=HarmonyToolParser)
    for c in chunks:
        choice.add(c)
    body = choice.body()
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] is None
    assert [t["function"]["name"] for t in body["message"]["tool_calls"]] == ["get_weather"]
    assert body["message"].get("reasoning_content", body["message"].get("reasoning")) == (
        THINK if include_reasoning else None
    )


def test_a_call_on_the_analysis_channel_and_a_header_cut_off():
    """gpt-oss writes some calls on ``analysis`` (vLLM reads them too): still a call. A header cut off by a limit
    after whole messages is no text of the answer."""
    thought = "<|channel|>analysis<|message|>Need the weather.<|end|>"
    call = '<|start|>assistant<|channel|>analysis to=functions.get_weather code<|message|>{"city": "Rome"}'
    assert run(thought + call, [25]) == ("Need the weather.", "", [("get_weather", {"city": "Rome"})])
    for cut in ("<|start|>assistant<|channel|>final", "<|start|>assistant<|channel|>commentary to=functions.f <|con"):
        assert run(thought + cut, [7]) == ("Need the weather.", "", [])


# ---- the engine: a constraint applies to the final channel ------------------------------------------------
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
ANALYSIS, ANSWER = "Let me think", '{"answer":4}'
# After the prompt's last token: the analysis, then the final channel's header and the answer (each token once)
HARMONY_SCRIPT = f"{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def harmony_llm(tmp_path_factory, tokenizer):
    """The scripted model (``scripted_model.py``) with gpt-oss's template and markers: after ``?`` it says
    ``HARMONY_SCRIPT``. No reasoning parser is named: the template brings Harmony's."""
    from scripted_model import make_scripted_model

    from cb_serve import LLM

    directory = tmp_path_factory.mktemp("harmony")
    setup = dict(added=HARMONY_TOKENS, special=True, template=TEMPLATE)
    make_scripted_model(directory, tokenizer, HARMONY_SCRIPT, {"?": HARMONY_SCRIPT}, **setup)
    return LLM(str(directory), max_model_len=256, num_gpu_blocks=64)


def harmony_text(llm, constraint, prompt: str = "<|start|>user<|message|>What is 2 + 2?") -> str:
    from cb_serve import SamplingParams

    prompt = llm.engine.tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False, structured_outputs=constraint)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_a_constraint_applies_to_the_final_channel_after_the_analysis(harmony_llm):
    from cb_serve import StructuredOutputsParams

    assert harmony_text(harmony_llm, None) == HARMONY_SCRIPT
    assert harmony_llm.engine.structured.reasoning.end_ids == tuple(
        harmony_llm.engine.tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)
    )
    # the analysis and the header (which JSON refuses) came out unmasked; the answer is the schema's
    assert harmony_text(harmony_llm, StructuredOutputsParams(json=ANSWER_SCHEMA)) == HARMONY_SCRIPT
    text = harmony_text(harmony_llm, StructuredOutputsParams(regex="(yes|no)"))
    assert text.removeprefix(HARMONY_SCRIPT.removesuffix(ANSWER)) in ("yes", "no")
    assert HarmonySplitter().split(text)[1] in ("yes", "no")  # the content is the final channel's


def test_a_grammar_enabled_in_reasoning_applies_from_the_first_token(harmony_llm):
    """As Harmony's forced tool calls are (their grammar writes the whole turn)."""
    from cb_serve import StructuredOutputsParams

    text = harmony_text(harmony_llm, StructuredOutputsParams(regex="(yes|no)", enable_in_reasoning=True))
    assert text in ("yes", "no")
    forced = HarmonyToolParser.constraint([WEATHER], parallel=False, template=TEMPLATE)
    assert forced.enable_in_reasoning


def test_where_an_output_starts_and_a_raw_prompt(harmony_llm):
    """In the analysis after a message that has not opened the final channel; in the answer after one that has
    (``continue_final_message``) and after a prompt with no Harmony message, whose constraint applies at once."""
    from cb_serve import StructuredOutputsParams

    end, encode = harmony_llm.engine.structured.reasoning, harmony_llm.engine.tokenizer.encode
    starts = lambda text: end.starts_in_reasoning(encode(text, add_special_tokens=False))  # noqa: E731
    assert starts("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert starts("<|start|>assistant<|channel|>final<|message|>Old.<|end|><|start|>assistant<|channel|>analysis")
    assert starts("<|start|>assistant<|channel|>final")  # the header may end in the output
    assert not starts("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Par")
    assert not starts("What is 2 + 2?")
    text = harmony_text(harmony_llm, StructuredOutputsParams(regex="(yes|no)"), prompt="What is 2 + 2?")
    assert text in ("yes", "no")
