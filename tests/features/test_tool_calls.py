"""Tool calling (issue 23): the ``<tool_call>`` parser (whole and streamed at every split), the
built-in tool prompt for templates without tools, the request validation of tools and
``tool_choice``, the response shapes (message and stream deltas), and, in the engine, required and
named choices whose calls always parse and fit the tool's schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from tool_defs import CLOCK, WEATHER

from cb_serve import InvalidRequestError, ToolCallParser, tool_call_constraint
from cb_serve.chat_template import apply_chat_template
from cb_serve.serve.engine_chunk import EngineChunk
from cb_serve.serve.protocol import ChatCompletionRequest
from cb_serve.serve.responses import Choice
from cb_serve.tool_format import closed, render_builtin, template_supports_tools, tool_call_schema

TEXT = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)


def parse_all(pieces: list[str]) -> tuple[str, list]:
    parser = ToolCallParser()
    content = "".join(parser.feed(p)[0] for p in pieces) + parser.finish()
    return content, parser.calls


def test_parser_whole_and_streamed_at_every_split_agree():
    content, calls = parse_all([TEXT])
    assert content == "Sure.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "UTC"}),
    ]
    for cut in range(1, len(TEXT)):
        got_content, got = parse_all([TEXT[:cut], TEXT[cut:]])
        assert got_content == content and [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]
    one_char = parse_all(list(TEXT))
    assert one_char[0] == content and len(one_char[1]) == 2


@pytest.mark.parametrize(
    "text, content, names",
    [
        ("no calls at all, a < sign and <tool", "no calls at all, a < sign and <tool", []),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),  # stays content
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
        ('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b"}]</tool_call>', "", ["a", "b"]),  # a list
        ('<tool_call>\n{"name": "a", "arguments": {"x": 1', '<tool_call>\n{"name": "a", "arguments": {"x": 1', []),
    ],
)
def test_parser_edge_cases(text, content, names):
    got_content, calls = parse_all([text])
    assert got_content == content and [c.name for c in calls] == names


def test_call_ids_are_unique_and_openai_shaped():
    _, calls = parse_all([TEXT])
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].to_openai(0) == {
        "index": 0,
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def test_builtin_prompt_renders_tools_calls_and_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
        ]},
        {"role": "tool", "tool_call_id": "1", "content": "18C"},
        {"role": "tool", "tool_call_id": "2", "content": "12:00"},
    ]  # fmt: skip
    out = render_builtin(messages, [WEATHER, CLOCK])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_time"' in out[0]["content"]
    assert parse_all([out[2]["content"]])[1][1].name == "get_time"
    assert out[3]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)


def test_chat_template_without_tools_gets_the_builtin_prompt(tokenizer):
    assert not template_supports_tools(tokenizer)  # SmolLM2's template ignores tools
    messages = [{"role": "user", "content": "hi"}]
    with_tools = tokenizer.decode(apply_chat_template(tokenizer, messages, tools=[WEATHER]))
    assert "<tools>" in with_tools and "get_weather" in with_tools
    assert apply_chat_template(tokenizer, messages, tools=None) == apply_chat_template(tokenizer, messages)


def test_chat_template_with_tools_renders_them_itself(tokenizer):
    class ToolTemplate:  # a template that renders tools (as Qwen2.5's does): given them, not the built-in prompt
        chat_template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[-1].content }}"
        seen = None

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
            self.seen = (messages, tools)
            return [1, 2, 3]

    fake = ToolTemplate()
    assert template_supports_tools(fake)
    messages = [{"role": "user", "content": "hi"}]
    apply_chat_template(fake, messages, tools=[WEATHER])
    assert fake.seen == (messages, [WEATHER])


def request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})


def test_tool_choice_modes_and_their_constraints():
    assert request().tool_mode == "none" and request(tools=[WEATHER]).tool_mode == "auto"
    assert request(tools=[WEATHER]).constraint() is None  # auto: the model chooses; the text is parsed
    assert request(tools=[WEATHER], tool_choice="none").prompt_tools() is None
    required = request(tools=[WEATHER, CLOCK], tool_choice="required").constraint()
    assert required.kind == "grammar" and '("\\n" call)*' in required.grammar
    single = request(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False).constraint()
    assert '("\\n" call)*' not in single.grammar
    named = request(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in named.constraint().grammar and "get_weather" not in named.constraint().grammar


def test_forced_calls_are_written_in_the_model_format():
    """The request's grammar comes from the model's format (``write_calls``: the HTTP layer passes the parser's
    ``constraint`` with the chat template), for the chosen tools and parallelism."""
    import functools

    from cb_serve import MistralToolParser

    write = functools.partial(MistralToolParser.constraint, template="... '[TOOL_CALLS]' + name + '[ARGS]' ...")
    named = {"type": "function", "function": {"name": "get_time"}}
    params = request(tools=[WEATHER, CLOCK], tool_choice=named).to_sampling_params(16, None, write)
    grammar = params.structured_outputs.grammar
    assert '<special:"[TOOL_CALLS]">' in grammar and '"get_time"' in grammar and "get_weather" not in grammar
    assert "call*" not in grammar  # a named tool: one call
    required = request(tools=[WEATHER, CLOCK], tool_choice="required").to_sampling_params(16, None, write)
    assert "call*" in required.structured_outputs.grammar and "get_weather" in required.structured_outputs.grammar


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "deep", "parameters": {"a": [[[[[[[[[[[[[[[[[[[[
            [[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}}]}, "tools"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_invalid_requests(body, param):
    with pytest.raises(InvalidRequestError) as e:
        request(**body).to_sampling_params(16, None)
    assert e.value.param == param


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{"type": "function", "function": {"name": "has space"}}]},
        {"tools": [{"type": "retrieval"}]},
        {"tool_choice": "sometimes"},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
        {
            "messages": [
                {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
            ]
        },  # noqa: E501
    ],
)
def test_malformed_tools_fail_validation(body):
    with pytest.raises(ValueError):
        request(**body)


def test_history_with_tool_calls_and_results_is_accepted():
    req = request(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    ], tools=[WEATHER])  # fmt: skip
    assert req.unsupported() == []
    rendered = [m.to_template() for m in req.messages]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert rendered[2] == {"role": "tool", "content": "20C", "tool_call_id": "c1"}
    assert request(messages=[{"role": "function", "name": "f", "content": "x"}]).unsupported()


def chunks(text: str, finish: str = "stop", size: int = 7) -> list[EngineChunk]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    last = len(pieces) - 1
    return [
        EngineChunk(0, p, 1, None, finish if i == last else None, None, 5, 0, None, "replica")
        for i, p in enumerate(pieces)
    ]


def test_response_message_and_stream_deltas_carry_the_calls():
    whole = Choice(0, chat=True, tools=True)
    for c in chunks(TEXT):
        whole.add(c)
    body = whole.body()
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] == "Sure.\n"
    assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == ["get_weather", "get_time"]
    streamed = Choice(0, chat=True, tools=True)
    deltas = [d for d in (streamed.delta(c) for c in chunks(TEXT)) if d is not None]
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(d["delta"]["content"] or "" for d in deltas) == "Sure.\n"
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"]) for t in calls] == [(0, "get_weather"), (1, "get_time")]
    assert all("<tool_call>" not in (d["delta"]["content"] or "") for d in deltas)
    assert deltas[-1]["finish_reason"] == "tool_calls" and all(d["finish_reason"] is None for d in deltas[:-1])
    cut = Choice(0, chat=True, tools=True)
    for c in chunks(TEXT[:60], finish="length"):
        cut.add(c)
    assert cut.body()["finish_reason"] == "length" and "tool_calls" not in cut.body()["message"]


def test_tool_call_schema_keeps_refs_and_closes_plain_objects():
    kids, x = {"type": "array", "items": {"$ref": "#"}}, {"$ref": "#/$defs/X"}
    node = {"type": "object", "properties": {"kids": kids, "x": x}, "$defs": {"X": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "tree", "parameters": node}}
    schema = tool_call_schema([tool, WEATHER])
    call = {"name": "tree", "arguments": {"x": 1, "kids": [{"x": 2, "kids": []}]}}
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "tree", "arguments": {"x": "one"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris", "invented": 1}}, schema)
    assert closed({"anyOf": [{"type": "object"}]}) == {"anyOf": [{"type": "object"}]}


@pytest.mark.parametrize("mode", ["named", "required"])
def test_enforced_calls_parse_and_fit_the_schema_in_the_engine(tiny_llm, mode):
    """A random model under the grammar: every call parses, names a given tool, and its arguments
    validate against that tool's parameters (n = 3 sampled sequences and one greedy)."""
    from cb_serve import SamplingParams

    tools = [WEATHER, CLOCK]
    chosen = [CLOCK] if mode == "named" else tools
    constraint = tool_call_constraint(chosen, parallel=mode == "required")
    params = [
        SamplingParams(temperature=0, max_tokens=120, structured_outputs=constraint),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=120, structured_outputs=constraint),
    ]
    outs = tiny_llm.chat([[{"role": "user", "content": "Paris?"}]] * 2, params, tools=tools, use_tqdm=False)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for out in (o for r in outs for o in r.outputs):
        _, calls = parse_all([out.text])
        assert calls, out.text
        if out.finish_reason == "stop":
            assert out.text.endswith("</tool_call>")
        for call in calls:
            assert call.name in {t["function"]["name"] for t in chosen}
            jsonschema.validate(json.loads(call.arguments), by_name[call.name])


def test_content_after_a_call_does_not_depend_on_the_chunking():
    text = TEXT + "\n\nDone."
    whole = parse_all([text])[0]
    assert whole == "Sure.\n\n\nDone."
    for cut in range(len(TEXT) - 5, len(text)):
        assert parse_all([text[:cut], text[cut:]])[0] == whole
    assert parse_all([TEXT, "\n", "\n"])[0] == "Sure.\n"  # trailing newlines after calls are not content


def test_parallel_tool_calls_false_keeps_one_call_in_auto_too():
    one = Choice(0, chat=True, tools=True, max_calls=1)
    for c in chunks(TEXT):
        one.add(c)
    assert [c["function"]["name"] for c in one.body()["message"]["tool_calls"]] == ["get_weather"]
    streamed = Choice(0, chat=True, tools=True, max_calls=1)
    calls = [t for c in chunks(TEXT) if (d := streamed.delta(c)) for t in d["delta"].get("tool_calls", [])]
    assert [t["function"]["name"] for t in calls] == ["get_weather"]


def test_free_form_and_non_object_parameters():
    free = {"type": "object"}  # any arguments: left open
    assert closed(free) == free
    with pytest.raises(InvalidRequestError) as e:
        bad = {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
        request(tools=[bad]).to_sampling_params(16, None)
    assert e.value.param == "tools"
    big = {"type": "object", "properties": {f"p{i:05d}": {"type": "string"} for i in range(1500)}}
    many = [{"type": "function", "function": {"name": f"t{i}", "parameters": big}} for i in range(3)]
    with pytest.raises(InvalidRequestError) as e:  # each within the caps, together over the grammar's
        request(tools=many, tool_choice="required").to_sampling_params(16, None)
    assert e.value.param == "tools" and "together" in str(e.value)
    assert request(tools=many).to_sampling_params(16, None).structured_outputs is None  # auto compiles nothing


# ---- Qwen3-Coder / Qwen3.5: XML calls (issue 52) -------------------------------------------------
QWEN3_CODER_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen3_coder.jinja").read_text()
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string"},
                "days": {"type": "integer"},
                "hourly": {"type": "boolean"},
                "place": {"type": "object"},
            },
        },
    },
}
CALLS = [
    ("forecast", {"city": "New York\nNY", "zip": "10001", "days": 3, "hourly": True, "place": {"lat": 40.7}}),
    ("get_time", {"tz": "UTC"}),
]


def qwen3_coder_reply(tokenizer, calls: list[tuple[str, dict]], content: str = "") -> str:
    """What the model writes for ``calls``: the assistant turn the real template renders for them."""
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[FORECAST, CLOCK], chat_template=QWEN3_CODER_TEMPLATE, tokenize=False
    )
    return text.rsplit("<|im_start|>assistant", 1)[1].removesuffix("<|im_end|>\n").removeprefix("\n")


def test_qwen3_coder_calls_from_the_real_template_parse_back_whole_and_streamed(tokenizer):
    from cb_serve import Qwen3CoderToolParser, tool_call_parser_for_template

    assert tool_call_parser_for_template(QWEN3_CODER_TEMPLATE) == "qwen3_coder"
    assert tool_call_parser_for_template(tokenizer.chat_template) == "hermes"  # SmolLM2: the built-in prompt
    reply = qwen3_coder_reply(tokenizer, CALLS, content="Let me check.")
    assert "<function=forecast>" in reply and "<parameter=days>\n3\n</parameter>" in reply

    def parse(pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
        parser = Qwen3CoderToolParser([FORECAST, CLOCK])
        content = "".join(parser.feed(p)[0] for p in pieces) + parser.finish()
        return content, [(c.name, json.loads(c.arguments)) for c in parser.calls]

    content, calls = parse([reply])
    assert content.strip() == "Let me check." and calls == CALLS  # "10001" stays a string: its schema says so
    for cut in range(1, len(reply), 3):
        assert parse([reply[:cut], reply[cut:]]) == (content, calls)
    json_block = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'  # a forced call
    assert parse([json_block])[1] == [("get_time", {"tz": "CET"})]


def test_qwen3_coder_malformed_or_cut_calls_come_back_as_text(tokenizer):
    from cb_serve import Qwen3CoderToolParser

    reply = qwen3_coder_reply(tokenizer, CALLS[:1])
    for cut in range(len(reply) - len("</tool_call>")):
        parser = Qwen3CoderToolParser([FORECAST])
        assert parser.feed(reply[:cut])[0] + parser.finish() == reply[:cut] and not parser.calls
    for bad in ("<function=f>\n<parameter=x>1</parameter>\ntrailing text\n</function>", "<function=f>\n1", "x"):
        parser = Qwen3CoderToolParser()
        text = f"<tool_call>\n{bad}\n</tool_call>"
        assert parser.feed(text)[0] + parser.finish() == text and not parser.calls


def test_the_tool_call_parser_engine_argument_is_checked():
    from cb_serve import EngineConfig
    from cb_serve.config.engine import TOOL_CALL_PARSERS as NAMES
    from cb_serve.tool_parsers import TOOL_CALL_PARSERS

    assert NAMES == list(TOOL_CALL_PARSERS) and all(TOOL_CALL_PARSERS[n].name == n for n in NAMES)
    assert EngineConfig(tool_call_parser="qwen3_coder").tool_call_parser == "qwen3_coder"
    with pytest.raises(ValueError, match="tool_call_parser"):
        EngineConfig(tool_call_parser="nope")


def test_a_response_choice_takes_the_model_format_parser(tokenizer):
    """The HTTP layer's choices parse with the parser the pipeline chose (``ResponseMeta.tool_parser``)."""
    import functools

    from cb_serve import Qwen3CoderToolParser

    reply = qwen3_coder_reply(tokenizer, CALLS)
    choice = Choice(0, chat=True, tools=True, tool_parser=functools.partial(Qwen3CoderToolParser, [FORECAST, CLOCK]))
    for c in chunks(reply):
        choice.add(c)
    body = choice.body()
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] is None
    got = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in body["message"]["tool_calls"]]
    assert got == CALLS


# ---- Llama 3.x: the reply is a JSON call (issue 52) -------------------------------------------------
LLAMA3_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "llama3_json.jinja").read_text()


def llama3_reply(tokenizer, name: str, arguments: dict) -> str:
    """What the model writes for one call: the assistant turn the real template renders for it."""
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = tokenizer.apply_chat_template(
        messages, tools=[FORECAST, CLOCK], chat_template=LLAMA3_TEMPLATE, tokenize=False
    )
    return text.rsplit("<|start_header_id|>assistant<|end_header_id|>\n\n", 1)[1].removesuffix("<|eot_id|>")


def test_llama3_json_calls_from_the_real_template_parse_back_whole_and_streamed(tokenizer):
    from cb_serve import Llama3JsonToolParser, tool_call_parser_for_template

    assert tool_call_parser_for_template(LLAMA3_TEMPLATE) == "llama3_json"
    name, arguments = CALLS[0]
    reply = llama3_reply(tokenizer, name, arguments)
    assert reply.startswith('{"name": "forecast", "parameters": ')

    def parse(pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
        parser = Llama3JsonToolParser([FORECAST, CLOCK])
        content = "".join(parser.feed(p)[0] for p in pieces) + parser.finish()
        return content, [(c.name, json.loads(c.arguments)) for c in parser.calls]

    assert parse([reply]) == ("", [CALLS[0]])
    for cut in range(1, len(reply), 3):
        assert parse([reply[:cut], reply[cut:]]) == ("", [CALLS[0]])
    two = f'{reply}; {{"name": "get_time", "parameters": {{"tz": "UTC"}}}}'
    assert parse([two]) == ("", CALLS)
    for text in ("It is sunny.", reply[:-3], '{"temp": 18}', "  {not json"):  # plain, cut, not a call, malformed
        assert parse([text]) == (text, [])
    block = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'  # a forced call
    assert parse([block]) == ("Sure. ", [("get_time", {"tz": "CET"})])
    choice = Choice(0, chat=True, tools=True, tool_parser=Llama3JsonToolParser)  # the call completes at the end
    deltas = [d for d in (choice.delta(c) for c in chunks(reply)) if d is not None]
    calls = [t["function"]["name"] for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert calls == ["forecast"] and deltas[-1]["finish_reason"] == "tool_calls"


# ---- Mistral: [TOOL_CALLS] then a JSON list, or NAME[ARGS]{...} per call (issue 52) ------------------
MISTRAL_TEMPLATES = {
    name: (Path(__file__).parents[1] / "fixtures" / "chat_templates" / f"{name}.jinja").read_text()
    for name in ("mistral3_json", "ministral3", "mistral_small_3_2")
}


def mistral_reply(tokenizer, template: str, calls: list[tuple[str, dict]], content: str = "") -> str:
    """What the model writes for ``calls``: the assistant turn the real template renders for them."""
    tool_calls = [
        {"id": f"a{i}bcdefgh", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[FORECAST, CLOCK], chat_template=template, tokenize=False)
    return text.split("[/INST]", 1)[1].removesuffix(tokenizer.eos_token)


@pytest.mark.parametrize("template", MISTRAL_TEMPLATES)
def test_mistral_calls_from_the_real_templates_parse_back_whole_and_streamed(tokenizer, template):
    from cb_serve import MistralToolParser, tool_call_parser_for_template

    assert tool_call_parser_for_template(MISTRAL_TEMPLATES[template]) == "mistral"
    reply = mistral_reply(tokenizer, MISTRAL_TEMPLATES[template], CALLS)
    expect_start = {
        "mistral3_json": "[TOOL_CALLS] [{",
        "ministral3": "[TOOL_CALLS]forecast[ARGS]{",
        "mistral_small_3_2": "[TOOL_CALLS]forecast[CALL_ID]a0bcdefgh[ARGS]{",
    }[template]
    assert reply.startswith(expect_start), reply

    def parse(pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
        parser = MistralToolParser([FORECAST, CLOCK])
        content = "".join(parser.feed(p)[0] for p in pieces) + parser.finish()
        return content, [(c.name, json.loads(c.arguments)) for c in parser.calls]

    assert parse([reply]) == ("", CALLS)
    for cut in range(1, len(reply), 2):
        assert parse([reply[:cut], reply[cut:]]) == ("", CALLS)
    assert parse(["Let me look. ", reply]) == ("Let me look. ", CALLS)  # content before the marker streams
    choice = Choice(0, chat=True, tools=True, tool_parser=MistralToolParser)  # the HTTP message
    for c in chunks("Let me look. " + reply):
        choice.add(c)
    body = choice.body()
    got = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in body["message"]["tool_calls"]]
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] == "Let me look. " and got == CALLS
    if template == "ministral3":  # the first call is read once the second's marker closes it
        parser = MistralToolParser()
        second = reply.index("[TOOL_CALLS]", 1)
        assert parser.feed(reply[: second + 3])[1] == []
        assert [c.name for c in parser.feed(reply[second + 3 :])[1]] == ["forecast"]
        assert parser.finish() == "" and [c.name for c in parser.calls] == ["forecast", "get_time"]


def test_mistral_malformed_or_cut_calls_come_back_as_text():
    from cb_serve import MistralToolParser

    good = '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    for text in (good[:-1], good[: len("[TOOL_CALLS]get_")], '[TOOL_CALLS] [{"name": 3}]', "[TOOL_CALLS]", "plain"):
        parser = MistralToolParser()
        assert parser.feed(text)[0] + parser.finish() == text and not parser.calls, text
    parser = MistralToolParser()  # a bad call after a good one: the good one stays a call
    content = parser.feed(good + "[TOOL_CALLS]oops{")[0] + parser.finish()
    assert content == "[TOOL_CALLS]oops{" and [c.name for c in parser.calls] == ["get_time"]
    parser = MistralToolParser()  # the older v11 form without [ARGS], and a call id
    parser.feed('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "CET"}[TOOL_CALLS]get_time{"tz": "UTC"}')
    assert parser.finish() == "" and [json.loads(c.arguments)["tz"] for c in parser.calls] == ["CET", "UTC"]
    block = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'  # a forced call
    parser = MistralToolParser()
    assert parser.feed(block)[0] + parser.finish() == "Sure. " and [c.name for c in parser.calls] == ["get_time"]


def test_mistral_markers_reach_the_parser_only_with_special_tokens_kept(tokenizer):
    """``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens in Mistral's tokenizers: the default detokenization
    drops them, so a request read by the Mistral parser keeps special tokens (vLLM's ``adjust_request``)."""
    import copy

    from cb_serve import MistralToolParser
    from cb_serve.engine.detokenizer import IncrementalDetokenizer

    assert MistralToolParser.keeps_special_tokens and not ToolCallParser.keeps_special_tokens
    mistral = copy.deepcopy(tokenizer)
    mistral.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    reply = mistral_reply(tokenizer, MISTRAL_TEMPLATES["ministral3"], CALLS[1:])
    ids = mistral.encode(reply, add_special_tokens=False)
    assert mistral.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    for keep in (True, False):
        detok = IncrementalDetokenizer(mistral, [], skip_special_tokens=not keep)
        parser, content = MistralToolParser(), ""
        for token_id in ids:
            before = len(detok.text)
            detok.append(token_id)
            content += parser.feed(detok.text[before:])[0]
        content += parser.finish()
        calls = [(c.name, json.loads(c.arguments)) for c in parser.calls]
        assert (calls, content) == (
            (CALLS[1:], "") if keep else ([], reply.replace("[TOOL_CALLS]", "").replace("[ARGS]", ""))
        )


# ---- Granite 3.x: the reply is <|tool_call|> then a JSON list (issue 52) -------------------------------
GRANITE_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "granite3.jinja").read_text()


def test_granite_calls_in_the_format_its_template_asks_for_parse_back_whole_and_streamed(tokenizer):
    """Granite 3.3's template renders no assistant calls; its system prompt asks for ``<|tool_call|>`` and a JSON
    list, which is what the model card shows. The marker is a special token: with it skipped the list is read."""
    from cb_serve import GraniteToolParser, tool_call_parser_for_template

    assert tool_call_parser_for_template(GRANITE_TEMPLATE) == "granite"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather?"}], tools=[FORECAST, CLOCK], chat_template=GRANITE_TEMPLATE,
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert "respond only with <|tool_call|> followed by a JSON list of tools used" in prompt
    assert prompt.endswith("<|start_of_role|>assistant<|end_of_role|>") and '"name": "forecast"' in prompt
    listed = json.dumps([{"name": n, "arguments": a} for n, a in CALLS])

    def parse(pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
        parser = GraniteToolParser([FORECAST, CLOCK])
        content = "".join(parser.feed(p)[0] for p in pieces) + parser.finish()
        return content, [(c.name, json.loads(c.arguments)) for c in parser.calls]

    for reply in ("<|tool_call|>" + listed, listed, " " + listed):  # the marker kept, skipped, after a space
        assert parse([reply]) == ("", CALLS)
        for cut in range(1, len(reply), 3):
            assert parse([reply[:cut], reply[cut:]]) == ("", CALLS)
    for text in ("It is sunny.", "<|tool_call|>" + listed[:-2], "[1, 2] are numbers.", "<|tool", "<b>hi</b>"):
        assert parse([text]) == (text, [])  # plain, cut, a list that is no call, a cut marker, a tag
    block = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'  # a forced call
    assert parse([block]) == ("Sure. ", [("get_time", {"tz": "CET"})])


# ---- DeepSeek V3 / V3.1: calls between its own delimiter tokens (issue 52) ------------------------------
DEEPSEEK_TEMPLATES = {
    name: (Path(__file__).parents[1] / "fixtures" / "chat_templates" / f"{name}.jinja").read_text()
    for name in ("deepseek_v3", "deepseek_v31")
}


def deepseek_reply(tokenizer, template: str, calls: list[tuple[str, dict]], content: str) -> str:
    """What the model writes for ``calls``: the assistant turn the real template renders for them (V3.1's
    template takes the arguments as JSON text)."""
    v31 = "thinking" in template
    tool_calls = [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a) if v31 else a}} for n, a in calls
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[FORECAST, CLOCK], chat_template=template, tokenize=False)
    reply = text.split("</think>", 1)[1] if v31 else text.rsplit("<｜Assistant｜>", 1)[1]
    return reply.split("<｜end▁of▁sentence｜>")[0].strip()  # (V3's template indents the turn)


@pytest.mark.parametrize("template", DEEPSEEK_TEMPLATES)
def test_deepseek_calls_from_the_real_templates_parse_back_whole_and_streamed(tokenizer, template):
    from cb_serve import DeepSeekV3ToolParser, tool_call_parser_for_template

    assert tool_call_parser_for_template(DEEPSEEK_TEMPLATES[template]) == "deepseek_v3"

    def parse(pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
        parser = DeepSeekV3ToolParser([FORECAST, CLOCK])
        content = "".join(parser.feed(p)[0] for p in pieces) + parser.finish()
        return content, [(c.name, json.loads(c.arguments)) for c in parser.calls]

    for content in ("", "Let me check."):
        reply = deepseek_reply(tokenizer, DEEPSEEK_TEMPLATES[template], CALLS, content)
        assert "<｜tool▁call▁begin｜>" in reply and reply.endswith("<｜tool▁calls▁end｜>"), reply
        assert parse([reply]) == (content, CALLS)
        for cut in range(1, len(reply), 3):
            assert parse([reply[:cut], reply[cut:]]) == (content, CALLS)
    block = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'  # a forced call
    assert parse([block]) == ("Sure. ", [("get_time", {"tz": "CET"})])


def test_deepseek_malformed_or_cut_calls_come_back_as_text():
    from cb_serve import DeepSeekV3ToolParser

    call = '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "UTC"}<｜tool▁call▁end｜>'
    for bad in (call[:-3], call.replace('{"tz"', "{tz"), call.replace("<｜tool▁sep｜>", ""), "plain <｜tool▁"):
        parser = DeepSeekV3ToolParser()
        assert parser.feed(bad)[0] + parser.finish() == bad and not parser.calls, bad


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "llama3_json", "mistral", "granite", "deepseek_v3"])
def test_json_nested_past_the_interpreters_depth_stays_text(name):
    """A model stuck writing ``[`` reaches Python's recursion limit in ``json``: the text stays content."""
    from cb_serve import TOOL_CALL_PARSERS

    body = "[" * 5000
    wrapped = {
        "mistral": '[TOOL_CALLS]f[ARGS]{"a": ' + body + "}",
        "granite": "<|tool_call|>" + body,
        "llama3_json": '{"name": "f", "parameters": ' + body + "}",
        "deepseek_v3": "<｜tool▁call▁begin｜>f<｜tool▁sep｜>" + body + "<｜tool▁call▁end｜>",
    }.get(name, "<tool_call>" + body + "</tool_call>")
    parser = TOOL_CALL_PARSERS[name]()
    content = parser.feed(wrapped)[0] + parser.finish()
    assert not parser.calls and content.replace("<｜tool▁calls▁begin｜>", "") == wrapped


def test_qwen3_coder_text_values_and_what_its_xml_cannot_spell():
    """An enum of strings is text whatever it looks like; a string with a pattern or format, or a key the tag
    would misread, makes a forced call a JSON block (which the parser reads too)."""
    from cb_serve import Qwen3CoderToolParser

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {"enum": ["1", "true"]}}, "required": ["v"]}}}  # fmt: skip
    parser = Qwen3CoderToolParser([tool])
    parser.feed("<tool_call>\n<function=f>\n<parameter=v>\n1\n</parameter>\n</function>\n</tool_call>")
    assert json.loads(parser.calls[0].arguments) == {"v": "1"}
    assert "<parameter=" in Qwen3CoderToolParser.constraint([tool], False).grammar
    for prop, key in (({"type": "string", "format": "date"}, "d"), ({"type": "integer"}, "a>b")):
        odd = {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {key: prop}, "required": [key]}}}  # fmt: skip
        grammar = Qwen3CoderToolParser.constraint([odd], False).grammar
        assert "<parameter=" not in grammar and '"<tool_call>\\n"' in grammar, grammar
