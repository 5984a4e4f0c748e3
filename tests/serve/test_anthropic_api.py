"""Anthropic's Messages API as a ``ChatFrontend`` (no Ray): the chat requests it makes validate as
``ChatCompletionRequest``; its bodies and stream events validate as the anthropic client's own
types; and the real ``anthropic`` client runs end to end against a FastAPI app that mounts the
frontend over a scripted generation (tool use over two turns, streaming, count_tokens, errors)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("fastapi")
import httpx2  # noqa: E402  (the anthropic client's HTTP library)
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from cb_serve import InvalidRequestError, ParsedToolCall  # noqa: E402
from cb_serve.serve.anthropic_api import MessagesFrontend, message_id  # noqa: E402
from cb_serve.serve.api_error import APIError  # noqa: E402
from cb_serve.serve.frontend_base import ChoiceDelta, ChoiceResult, ResponseContext, UsageInfo  # noqa: E402
from cb_serve.serve.protocol import ChatCompletionRequest  # noqa: E402

FRONTEND = MessagesFrontend()
CTX = ResponseContext("msg_0123abcd", 1_700_000_000, "served-model")
EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
USER = {"role": "user", "content": "Weather in Paris?"}
EPHEMERAL = {"type": "ephemeral"}
OBJECT = {"type": "object"}
NAMED = {"name": "get_weather"}
IMAGE = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a"}}


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def result_block(tool_use_id: str, content: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content}


def validate_chat(chat: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request as the router validates it."""
    return ChatCompletionRequest.model_validate(chat)


def to_chat(**fields: Any) -> dict[str, Any]:
    body = FRONTEND.request_model.model_validate({"model": "m", "max_tokens": 64, **fields})
    chat = FRONTEND.to_chat(body)
    validate_chat(chat)
    return chat


def test_conversation_round_trip() -> None:
    said = [
        {"type": "thinking", "thinking": "use a tool", "signature": "s"}, {"type": "redacted_thinking", "data": "x"},
        {"type": "text", "text": "Checking.", "citations": None},  # as the client sends a response's blocks back
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Nice"}},
    ]  # fmt: skip
    results = [
        {**result_block("toolu_1", "21 C"), "cache_control": EPHEMERAL},
        {**result_block("toolu_2", [text_block("down")]), "is_error": True}, text_block("And tomorrow?"),
    ]  # fmt: skip
    history = [{"role": "user", "content": [text_block("Weather in"), text_block("Paris?")]},
               {"role": "assistant", "content": said}, {"role": "user", "content": results}]  # fmt: skip
    system = [text_block("Be brief."), {**text_block("Use tools."), "cache_control": EPHEMERAL}]
    chat = to_chat(messages=history, system=system, tools=[WEATHER])
    calls = [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}},
    ]
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in\nParis?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    function = {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert chat["model"] == "m" and chat["max_tokens"] == 64 and chat["stream"] is False


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        ({"type": "tool", "name": "get_weather"}, {"tool_choice": {"type": "function", "function": NAMED}}),
        ({"type": "any", "disable_parallel_tool_use": True}, {"tool_choice": "required", "parallel_tool_calls": False}),
    ],
)  # fmt: skip
def test_tool_choice(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    chat = to_chat(messages=[USER], tools=[WEATHER], tool_choice=choice)
    assert {k: chat[k] for k in expected} == expected
    assert "parallel_tool_calls" in chat or "parallel_tool_calls" not in expected
    assert "tool_choice" not in to_chat(messages=[USER], tool_choice={"type": "auto"})  # no tools: nothing to choose


def test_sampling_and_options() -> None:
    chat = to_chat(
        messages=[USER], stop_sequences=["\n\n", "END"], temperature=0.5, top_p=0.9, top_k=40, stream=True,
        metadata={"user_id": "u-1"}, service_tier="auto",
        output_config={"format": {"type": "json_schema", "schema": OBJECT}},
    )  # fmt: skip
    assert chat["stop"] == ["\n\n", "END"] and chat["user"] == "u-1" and chat["stream"] is True
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (0.5, 0.9, 40)
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": {"type": "object"}},
    }
    on = FRONTEND.to_chat(FRONTEND.request_model.model_validate(
        {"model": "m", "max_tokens": 2048, "messages": [USER], "thinking": {"type": "enabled", "budget_tokens": 1024},
         "output_config": {"effort": "max"}}))  # fmt: skip
    assert on["reasoning_effort"] == "high" and "chat_template_kwargs" not in validate_chat(on).model_fields_set
    assert (
        to_chat(messages=[USER], thinking={"type": "adaptive"}, output_config={"effort": "low"})["reasoning_effort"]
        == "low"
    )
    off = to_chat(messages=[USER], thinking={"type": "disabled"}, output_config={"effort": "low"})
    assert off["chat_template_kwargs"] == {"enable_thinking": False} and "reasoning_effort" not in off
    prefill = to_chat(messages=[USER, {"role": "assistant", "content": "The answer is"}])
    assert prefill["continue_final_message"] and not prefill["add_generation_prompt"]
    assert prefill["messages"][-1] == {"role": "assistant", "content": "The answer is"}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": [{"role": "user", "content": [text_block("x"), DOCUMENT]}]}, "messages.0.content.1"),
        ({"messages": [{"role": "user", "content": [result_block("t", [IMAGE])]}]}, "messages.0.content.0.content.0"),
        ({"messages": [USER], "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}]}, "tools.1"),
        ({"messages": [USER], "container": "c-1"}, "container"),
        ({"messages": [USER], "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages.0.content.0"),
        ({"messages": [{"role": "assistant", "content": [result_block("t", "x")]}, USER]}, "messages.0.content.0"),
    ],
)  # fmt: skip
def test_refused_by_name(fields: dict[str, Any], param: str) -> None:
    body = FRONTEND.request_model.model_validate({"model": "m", "max_tokens": 8, **fields})
    with pytest.raises(InvalidRequestError) as refused:
        FRONTEND.to_chat(body)
    assert refused.value.param == param and param in str(refused.value)


@pytest.mark.parametrize(
    "fields, loc",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"frequency_penalty": 0.1}, "frequency_penalty"),  # not Anthropic's: unknown fields are refused
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, ""),  # at least max_tokens
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ],
)
def test_invalid_bodies(fields: dict[str, Any], loc: str) -> None:
    with pytest.raises(ValidationError) as refused:
        FRONTEND.request_model.model_validate({"model": "m", "max_tokens": 64, "messages": [USER], **fields})
    assert ".".join(str(p) for p in refused.value.errors()[0]["loc"]).startswith(loc)


CALL = ParsedToolCall("get_weather", '{"city": "Paris"}', id="call_abc")


@pytest.mark.parametrize(
    "choice, stop",
    [
        (ChoiceResult(0, "Hi.", None, [], "stop", 2), ("end_turn", None)),
        (ChoiceResult(0, "Hi", None, [], "stop", "END"), ("stop_sequence", "END")),
        (ChoiceResult(0, "Hi, th", None, [], "length"), ("max_tokens", None)),
        (ChoiceResult(0, "Let me check.", "They ask for weather.", [CALL], "tool_calls"), ("tool_use", None)),
        (ChoiceResult(0, None, None, [CALL], "stop"), ("tool_use", None)),
        (ChoiceResult(0, "", None, [], "abort"), (None, None)),
    ],
)
def test_response_body(choice: ChoiceResult, stop: tuple[str | None, str | None]) -> None:
    usage = UsageInfo(prompt_tokens=30, completion_tokens=7, cached_tokens=16)
    body = FRONTEND.response(CTX, None, choice, usage)  # type: ignore[arg-type]
    message = anthropic.types.Message.model_validate(body)
    assert (message.stop_reason, message.stop_sequence) == stop and message.id.startswith("msg_")
    kinds = (
        ["thinking"] * bool(choice.reasoning) + ["text"] * bool(choice.content) + ["tool_use"] * len(choice.tool_calls)
    )
    assert [b.type for b in message.content] == kinds
    if choice.tool_calls:
        assert message.content[-1].input == {"city": "Paris"} and message.content[-1].id == "toolu_abc"
    usage_seen = message.usage
    assert (usage_seen.input_tokens, usage_seen.cache_read_input_tokens, usage_seen.output_tokens) == (14, 16, 7)
    assert [message_id(ResponseContext(i, 0, "m")) for i in ("msg-ab", "x1")] == ["msg_ab", "msg_x1"]


async def scripted(
    deltas: list[ChoiceDelta], usage: UsageInfo, fail: APIError | None = None
) -> AsyncIterator[ChoiceDelta]:
    """A generation: usage is filled in before each delta, as the router does."""
    usage.prompt_tokens, usage.cached_tokens = 12, 4
    for delta in deltas:
        usage.completion_tokens += 1
        yield delta
    if fail is not None:
        raise fail


def run_events(deltas: list[ChoiceDelta], fail: APIError | None = None) -> list[dict[str, Any]]:
    async def collect() -> list[str]:
        usage = UsageInfo()
        return [e async for e in FRONTEND.events(CTX, None, scripted(deltas, usage, fail), usage)]  # type: ignore[arg-type]

    out = []
    for text in asyncio.run(collect()):
        name, data = text.removesuffix("\n\n").split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append(json.loads(data.removeprefix("data: ")))
        assert out[-1]["type"] == name.removeprefix("event: ")
    return out


def test_stream_events() -> None:
    deltas = [
        ChoiceDelta(0, reasoning="They ask "), ChoiceDelta(0, reasoning="for weather."),
        ChoiceDelta(0, content="Let me "), ChoiceDelta(0, content="check."),
        ChoiceDelta(0, tool_calls=[CALL]), ChoiceDelta(0, finish_reason="tool_calls"),
    ]  # fmt: skip
    events = run_events(deltas)
    for event in events:
        EVENT.validate_python(event)
    summary = [
        (e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events
    ]
    assert summary == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None), ("message_delta", None, None), ("message_stop", None, None),
    ]  # fmt: skip
    assert events[0]["message"]["usage"]["input_tokens"] == 8 and events[0]["message"]["content"] == []
    assert json.loads(events[10]["delta"]["partial_json"]) == {"city": "Paris"}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 6


def test_stream_error_and_empty() -> None:
    events = run_events(
        [ChoiceDelta(0, content="Hi")], APIError(503, "The engine replica failed.", "service_unavailable")
    )
    assert [e["type"] for e in events[:-1]] == ["message_start", "content_block_start", "content_block_delta"]
    anthropic.types.ErrorResponse.model_validate(events[-1])
    assert events[-1]["error"] == {"type": "overloaded_error", "message": "The engine replica failed."}
    events = run_events([ChoiceDelta(0, finish_reason="stop", stop_reason="END")])
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    assert events[1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


@pytest.mark.parametrize(
    "status, type_, expected",
    [
        (400, "invalid_request_error", "invalid_request_error"), (400, "unsupported", "invalid_request_error"),
        (401, "authentication_error", "authentication_error"), (404, "not_found_error", "not_found_error"),
        (409, "conflict_error", "invalid_request_error"), (415, "invalid_request_error", "invalid_request_error"),
        (503, "overloaded_error", "overloaded_error"), (503, "service_unavailable", "overloaded_error"),
        (500, "internal_error", "api_error"), (502, "bad_gateway", "api_error"), (429, "x", "rate_limit_error"),
    ],
)  # fmt: skip
def test_error_body(status: int, type_: str, expected: str) -> None:
    body = FRONTEND.error_body(status, type_, "went wrong", "param")
    assert anthropic.types.ErrorResponse.model_validate(body).error.type == expected
    assert FRONTEND.error_body(413, "invalid_request_error", "too big", None)["error"]["type"] == "request_too_large"


def fake_model(chat: ChatCompletionRequest) -> list[ChoiceDelta]:
    """Calls get_weather when it may, answers once the tool's result is in, else greets."""
    if chat.messages[-1].role == "tool":
        return [ChoiceDelta(0, content="It is "), ChoiceDelta(0, content=f"{chat.messages[-1].content} in Paris.")] + [
            ChoiceDelta(0, finish_reason="stop", stop_reason=2)
        ]
    if chat.tools:
        return [ChoiceDelta(0, content="Let me check."), ChoiceDelta(0, tool_calls=[CALL], finish_reason="tool_calls")]
    return [ChoiceDelta(0, content="Hello"), ChoiceDelta(0, content=", world"), ChoiceDelta(0, finish_reason="stop")]


async def whole(deltas: AsyncIterator[ChoiceDelta]) -> ChoiceResult:
    """The deltas collected into a choice (the router's job)."""
    content, reasoning, calls, finish, stop = "", "", [], None, None
    async for d in deltas:
        content, reasoning, calls = content + d.content, reasoning + d.reasoning, calls + d.tool_calls
        finish, stop = d.finish_reason or finish, d.stop_reason if d.finish_reason else stop
    return ChoiceResult(0, content or None, reasoning or None, calls, finish, stop)


def make_app(seen: list[ChatCompletionRequest], fail: APIError | None = None) -> FastAPI:
    """The router's part, for this frontend: parse, to_chat, validate, generate, respond."""
    app = FastAPI()

    def refuse(e: ValueError) -> JSONResponse:
        return JSONResponse(FRONTEND.error_body(400, "invalid_request_error", str(e), None), status_code=400)

    @app.post(FRONTEND.path)
    async def messages(request: Request) -> Any:
        try:
            body = FRONTEND.request_model.model_validate(await request.json())
            chat = validate_chat(FRONTEND.to_chat(body))
        except ValueError as e:  # ValidationError and InvalidRequestError
            return refuse(e)
        seen.append(chat)
        usage = UsageInfo()
        deltas = scripted(fake_model(chat), usage, fail)
        if chat.stream:
            return StreamingResponse(FRONTEND.events(CTX, body, deltas, usage), media_type="text/event-stream")
        return FRONTEND.response(CTX, body, await whole(deltas), usage)

    @app.post(FRONTEND.count_path)
    async def count_tokens(request: Request) -> Any:
        try:
            body = FRONTEND.count_request_model.model_validate(await request.json())
            chat = validate_chat(FRONTEND.count_to_chat(body))
        except ValueError as e:
            return refuse(e)
        words = sum(len(str(m.content).split()) for m in chat.messages) + 10 * len(chat.tools or ())
        return FRONTEND.count_response(words)

    return app


def client(app: FastAPI) -> Any:
    transport = httpx2.ASGITransport(app=app)
    http = httpx2.AsyncClient(transport=transport, base_url="http://test")
    return anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=http, max_retries=0)


def test_client_tool_use_over_two_turns() -> None:
    seen: list[ChatCompletionRequest] = []

    async def conversation() -> tuple[Any, Any]:
        api = client(make_app(seen))
        first = await api.messages.create(model="served-model", max_tokens=64, messages=[USER], tools=[WEATHER])
        history = [USER, {"role": "assistant", "content": first.content}]
        result = {"type": "tool_result", "tool_use_id": first.content[-1].id, "content": "21 C"}
        history.append({"role": "user", "content": [result]})
        async with api.messages.stream(model="served-model", max_tokens=64, messages=history, tools=[WEATHER]) as s:
            texts = [t async for t in s.text_stream]
            second = await s.get_final_message()
        return first, (texts, second)

    first, (texts, second) = asyncio.run(conversation())
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    tool = first.content[1]
    assert (tool.id, tool.name, tool.input) == ("toolu_abc", "get_weather", {"city": "Paris"})
    assert first.usage.input_tokens == 8 and first.usage.cache_read_input_tokens == 4
    assert seen[1].messages[-2].tool_calls[0].id == tool.id and seen[1].messages[-1].tool_call_id == tool.id
    assert seen[1].messages[-2].content == "Let me check." and seen[1].stream
    assert "".join(texts) == "It is 21 C in Paris." and second.content[0].text == "It is 21 C in Paris."
    assert (second.stop_reason, second.usage.output_tokens, second.usage.input_tokens) == ("end_turn", 3, 8)


def test_client_stream_count_and_errors() -> None:
    async def calls() -> tuple[Any, ...]:
        api = client(make_app([]))
        async with api.messages.stream(model="served-model", max_tokens=16, messages=[USER], system="Be brief.") as s:
            text = [t async for t in s.text_stream]
        count = await api.messages.count_tokens(
            model="served-model", messages=[USER], system="Be brief.", tools=[WEATHER]
        )
        with pytest.raises(anthropic.BadRequestError) as refused:
            await api.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [DOCUMENT]}])
        failing = client(make_app([], APIError(503, "The engine replica failed.", "service_unavailable")))
        with pytest.raises(anthropic.APIStatusError) as failed:
            async with failing.messages.stream(model="served-model", max_tokens=16, messages=[USER]) as s:
                await s.get_final_message()
        return text, count, refused.value, failed.value

    text, count, refused, failed = asyncio.run(calls())
    assert "".join(text) == "Hello, world"
    assert count.input_tokens == len("Be brief. Weather in Paris?".split()) + 10
    assert refused.body["error"]["type"] == "invalid_request_error" and "messages.0.content.0" in refused.message
    assert failed.body["error"] == {"type": "overloaded_error", "message": "The engine replica failed."}


def test_image_blocks_become_the_chat_api_s_image_parts() -> None:
    """Anthropic's image blocks (base64 or URL) become ``image_url`` parts in the blocks' order, beside the
    text; the chat request validates them (a text model refuses them later, at the router: a 400); an image
    in a tool result or an assistant turn is refused by name."""
    from cb_serve.serve.protocol import ChatCompletionRequest

    b64 = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    chat = to_chat(messages=[{"role": "user", "content": [text_block("Look"), b64, IMAGE]}])
    assert chat["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]}]  # fmt: skip
    assert ChatCompletionRequest.model_validate(chat).unsupported() == []
    for messages in ([{"role": "user", "content": [result_block("t", [IMAGE])]}],
                     [USER, {"role": "assistant", "content": [IMAGE]}]):  # fmt: skip
        with pytest.raises(InvalidRequestError):
            to_chat(messages=messages)
