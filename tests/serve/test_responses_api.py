"""OpenAI's Responses API frontend without Ray: request → chat request, scripted deltas → Response
objects and stream events (each validated by the ``openai`` package's own types), the stored
conversations behind ``previous_response_id``, and the real ``openai`` client and an Agents SDK
agent end to end over an in-process app."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

from cb_serve import InvalidRequestError, ParsedToolCall  # noqa: E402
from cb_serve.serve.api_error import APIError  # noqa: E402
from cb_serve.serve.frontend_base import ChoiceDelta, ChoiceResult, ResponseContext, UsageInfo  # noqa: E402
from cb_serve.serve.protocol import ChatCompletionRequest  # noqa: E402
from cb_serve.serve.response_store import ResponseStore  # noqa: E402
from cb_serve.serve.responses_api import ResponsesFrontend, ResponsesRequest  # noqa: E402

CTX = ResponseContext("req-1", 1_700_000_000, "fake-model")
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
CALL = ParsedToolCall("get_weather", '{"city": "Paris"}', id="call_1")


def body(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "fake-model", **fields})


def chat(frontend: ResponsesFrontend, req: ResponsesRequest) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(frontend.to_chat(req))


def messages(frontend: ResponsesFrontend, req: ResponsesRequest) -> list[dict[str, Any]]:
    drop = {"tool_calls": {"__all__": {"type"}}}
    return [m.model_dump(exclude_none=True, exclude=drop) for m in chat(frontend, req).messages]


async def _iterate(deltas: list[ChoiceDelta | Exception]) -> AsyncIterator[ChoiceDelta]:
    for delta in deltas:
        if isinstance(delta, Exception):
            raise delta
        yield delta


def stream(frontend: ResponsesFrontend, req: ResponsesRequest, deltas: list[Any]) -> list[Any]:
    """The events, each checked as ``event: <type>`` + ``data: <json>`` and validated by openai's types."""

    async def collect() -> list[str]:
        return [e async for e in frontend.events(CTX, req, _iterate(deltas), UsageInfo(7, 5, 2, 1))]

    events = []
    for text in asyncio.run(collect()):
        head, data, blank = text.split("\n", 2)
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {event.type}" and blank == "\n"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def function_call(call_id: str, city: str, **more: Any) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": "get_weather",
        "arguments": f'{{"city": "{city}"}}',
        **more,
    }


def test_to_chat_messages_tools_and_options() -> None:
    frontend = ResponsesFrontend()
    parts = [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris and Rome?"}]
    req = body(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": parts},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            function_call("c1", "Paris", id="fc_1", status="completed"),
            function_call("c2", "Rome"),
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rainy"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny; rainy.", "annotations": []}]},
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        max_output_tokens=64,
        temperature=0.5,
        top_p=0.9,
        reasoning={"effort": "low", "summary": "auto"},
        metadata={"k": "v"},
        user="u",
    )
    c = chat(frontend, req)
    calls = [
        {"id": f"c{i}", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
        for i, city in ((1, "Paris"), (2, "Rome"))
    ]
    assert messages(frontend, req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rainy", "tool_call_id": "c2"},
        {"role": "assistant", "content": "Sunny; rainy."},
    ]
    assert c.tools[0].function.name == "get_weather" and c.tools[0].function.strict is True
    assert c.tool_choice.function.name == "get_weather" and c.parallel_tool_calls is False
    schema = {"name": "w", "schema": {"type": "object"}, "strict": True}
    assert c.response_format == {"type": "json_schema", "json_schema": schema}
    assert (c.max_tokens, c.temperature, c.top_p, c.reasoning_effort) == (64, 0.5, 0.9, "low")
    assert (c.metadata, c.user, c.stream) == ({"k": "v"}, "u", False)
    plain = chat(frontend, body(input="hi", text={"format": {"type": "json_object"}}, stream=True))
    assert [m.content for m in plain.messages] == ["hi"] and plain.response_format == {"type": "json_object"}
    assert plain.stream and plain.tools is None and plain.max_tokens is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": []}, "input"),
    ],
)
def test_refused_with_the_parameter_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        ResponsesFrontend().to_chat(body(**{"input": "hi", **fields}))
    assert e.value.param == param


@pytest.mark.parametrize(
    "fields",
    [
        {"unknown": 1},
        {"include": ["nothing.known"]},
        {"stream": "yes"},
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
        {"text": {"format": {"type": "json_schema", "schema": {}}}},
        {"tools": [{"type": "function", "name": "f", "extra": 1}]},
    ],
)
def test_invalid_bodies(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        body(**{"input": "hi", **fields})
    body(input="hi", include=["reasoning.encrypted_content"], store=False, truncation="disabled", top_logprobs=0)


def test_whole_response_bodies() -> None:
    frontend, req = ResponsesFrontend(), body(input="hi", tools=[WEATHER], temperature=0.2)
    usage = UsageInfo(prompt_tokens=7, completion_tokens=5, cached_tokens=2, reasoning_tokens=1)
    whole = frontend.response(CTX, req, ChoiceResult(0, "Let me look.", "think", [CALL], "tool_calls"), usage)
    r = Response.model_validate(whole)
    assert r.id.startswith("resp_") and r.status == "completed" and r.model == "fake-model" and r.temperature == 0.2
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "think" and r.output[1].content[0].text == "Let me look."
    assert (r.output[2].call_id, r.output[2].arguments, r.output[2].id[:3]) == ("call_1", '{"city": "Paris"}', "fc_")
    assert r.usage.input_tokens_details.cached_tokens == 2 and r.usage.output_tokens_details.reasoning_tokens == 1
    assert r.usage.total_tokens == 12 and r.tools[0].name == "get_weather" and r.output_text == "Let me look."
    only_calls = frontend.response(CTX, req, ChoiceResult(0, None, None, [CALL], "tool_calls"), usage)
    calls_only = Response.model_validate(only_calls)
    assert [o.type for o in calls_only.output] == ["function_call"]
    cut = Response.model_validate(frontend.response(CTX, req, ChoiceResult(0, "abc", None, [], "length"), usage))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"
    assert frontend.error_body(404, "invalid_request_error", "gone", "previous_response_id") == {
        "error": {"message": "gone", "type": "invalid_request_error", "param": "previous_response_id", "code": 404}
    }


def test_stream_events() -> None:
    frontend, req = ResponsesFrontend(), body(input="hi", tools=[WEATHER], stream=True)
    deltas = [
        ChoiceDelta(0, reasoning="th"),
        ChoiceDelta(0, reasoning="ink", content="Let"),
        ChoiceDelta(0, content=" me."),
        ChoiceDelta(0, tool_calls=[CALL], finish_reason="tool_calls"),
    ]
    events = stream(frontend, req, deltas)
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        *item, "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done", *done,
        *item, "response.output_text.delta", "response.output_text.delta", "response.output_text.done", *done,
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1].response
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me."
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]
    assert final.usage.input_tokens == 7 and final.status == "completed"
    whole = frontend.response(CTX, req, ChoiceResult(0, "Let me.", "think", [CALL], "tool_calls"), UsageInfo())
    assert [o["type"] for o in whole["output"]] == [o.type for o in final.output]
    cut = stream(frontend, req, [ChoiceDelta(0, content="ab", finish_reason="length")])
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    empty = stream(frontend, req, [ChoiceDelta(0, finish_reason="stop")])
    assert [o.type for o in empty[-1].response.output] == ["message"] and empty[-1].response.output_text == ""


def test_failure_mid_stream() -> None:
    frontend = ResponsesFrontend()
    req = body(input="hi", stream=True)
    error = APIError(503, "The engine replica failed; retry.", "service_unavailable")
    events = stream(frontend, req, [ChoiceDelta(0, content="par"), error])
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "server_error" and "retry" in events[-1].response.error.message
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"
    assert len(frontend.store) == 0  # a failed response is not kept


def test_previous_response_id_continues_the_stored_conversation() -> None:
    frontend = ResponsesFrontend()
    first = body(input="Weather in Paris?", instructions="Old rules.", tools=[WEATHER])
    frontend.to_chat(first)
    turn1 = frontend.response(CTX, first, ChoiceResult(0, None, "think", [CALL], "tool_calls"), UsageInfo())
    output = [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    second = body(previous_response_id=turn1["id"], input=output, instructions="New rules.", tools=[WEATHER])
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert messages(frontend, second) == [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    events = stream(frontend, second, [ChoiceDelta(0, content="Sunny.", finish_reason="stop")])
    assert events[-1].response.previous_response_id == turn1["id"]
    third = body(previous_response_id=events[-1].response.id, input="Thanks", store=False)
    assert [m["role"] for m in messages(frontend, third)] == ["user", "assistant", "tool", "assistant", "user"]
    unstored = frontend.response(CTX, third, ChoiceResult(0, "Bye.", None, [], "stop"), UsageInfo())
    assert unstored["store"] is False
    for missing in (unstored["id"], "resp_unknown"):
        with pytest.raises(APIError) as e:
            frontend.to_chat(body(previous_response_id=missing, input="more"))
        assert (e.value.status, e.value.param) == (404, "previous_response_id")
        assert "per router replica" in e.value.message


def test_store_bounds() -> None:
    store = ResponseStore(max_entries=2, max_bytes=1000)
    message = [{"role": "user", "content": "x" * 100}]
    store.put("a", message), store.put("b", message)
    assert store.get("a") == message  # a is now the most recently used: b goes first
    store.put("c", message)
    assert "b" not in store and "a" in store and "c" in store
    assert not store.put("huge", [{"role": "user", "content": "x" * 2000}]) and "huge" not in store
    store.put("d", [{"role": "user", "content": "y" * 600}])  # over the byte cap with a: a goes
    assert list(store._entries) == ["c", "d"] and store.bytes <= 1000
    frontend = ResponsesFrontend(max_stored=1)
    ids = []
    for text in ("one", "two"):
        req = body(input=text)
        frontend.to_chat(req)
        ids.append(frontend.response(CTX, req, ChoiceResult(0, "ok", None, [], "stop"), UsageInfo())["id"])
    with pytest.raises(APIError, match="at most 1 of them"):
        frontend.to_chat(body(previous_response_id=ids[0], input="more"))
    continued = chat(frontend, body(previous_response_id=ids[1], input="more"))
    assert [m.content for m in continued.messages] == ["two", "ok", "more"]


def weather(chat_request: ChatCompletionRequest) -> list[ChoiceDelta]:
    """The scripted model: a tool call first, then the answer from the tool's output."""
    last = chat_request.messages[-1]
    if last.role != "tool":
        call = ParsedToolCall("get_weather", '{"city": "Paris"}')
        return [ChoiceDelta(0, reasoning="Look it up."), ChoiceDelta(0, tool_calls=[call], finish_reason="tool_calls")]
    called = {c.id for m in chat_request.messages if m.tool_calls for c in m.tool_calls}
    assert last.tool_call_id in called  # the output answers a call of the history
    return [ChoiceDelta(0, content="It is "), ChoiceDelta(0, content=f"{last.content} in Paris.", finish_reason="stop")]


def app_over(frontend: ResponsesFrontend, script: Callable[[ChatCompletionRequest], list[ChoiceDelta]]) -> FastAPI:
    """What the router does for a frontend, over a scripted generation."""
    app = FastAPI()

    @app.post(frontend.path)
    async def create(request: Request) -> Any:
        try:
            req = frontend.request_model.model_validate(await request.json())
            chat_request = ChatCompletionRequest.model_validate(frontend.to_chat(req))
        except (ValidationError, InvalidRequestError) as e:
            error = frontend.error_body(400, "invalid_request_error", str(e), getattr(e, "param", None))
            return JSONResponse(error, 400)
        except APIError as e:
            return JSONResponse(frontend.error_body(e.status, e.type, e.message, e.param), e.status)
        deltas = script(chat_request)
        usage = UsageInfo(prompt_tokens=10 * len(chat_request.messages), completion_tokens=len(deltas))
        ctx = ResponseContext("req", int(time.time()), "fake-model")
        if chat_request.stream:
            return StreamingResponse(frontend.events(ctx, req, _iterate(deltas), usage), media_type="text/event-stream")
        content = "".join(d.content for d in deltas)
        calls = [c for d in deltas for c in d.tool_calls]
        choice = ChoiceResult(0, content or None, "".join(d.reasoning for d in deltas), calls, deltas[-1].finish_reason)
        return JSONResponse(frontend.response(ctx, req, choice, usage))

    return app


def client_of(app: FastAPI) -> Any:
    transport = httpx2.ASGITransport(app=app)
    http = httpx2.AsyncClient(transport=transport, base_url="http://cb-serve")
    return openai.AsyncOpenAI(api_key="none", base_url="http://cb-serve/v1", http_client=http, max_retries=0)


def test_openai_client_end_to_end() -> None:
    client = client_of(app_over(ResponsesFrontend(), weather))
    tool = {**WEATHER, "parameters": {**WEATHER["parameters"], "additionalProperties": False}}

    async def scenario() -> None:
        first = await client.responses.create(model="fake-model", input="Weather in Paris?", tools=[tool])
        call = next(o for o in first.output if o.type == "function_call")
        history = [
            {"role": "user", "content": "Weather in Paris?"},
            *(o.model_dump(exclude_none=True) for o in first.output),
        ]
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        second = await client.responses.create(model="fake-model", input=[*history, output], tools=[tool])
        assert second.output_text == "It is sunny in Paris." and second.status == "completed"
        events = []
        async with await client.responses.create(model="fake-model", input="Paris?", tools=[tool], stream=True) as s:
            events = [e async for e in s]
        call = next(e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call")
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "cloudy"}
        async with await client.responses.create(
            model="fake-model", input=[output], previous_response_id=events[-1].response.id, tools=[tool], stream=True
        ) as s:
            text = "".join([e.delta async for e in s if e.type == "response.output_text.delta"])
        assert text == "It is cloudy in Paris."
        with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
            await client.responses.create(model="fake-model", input="x", previous_response_id="resp_gone")
        with pytest.raises(openai.BadRequestError, match="web_search"):
            await client.responses.create(model="fake-model", input="x", tools=[{"type": "web_search"}])

    asyncio.run(scenario())


def test_agents_sdk_agent_runs_a_tool_to_completion() -> None:
    agents = pytest.importorskip("agents")

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny" if city == "Paris" else "unknown"

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(client_of(app_over(ResponsesFrontend(), weather)), use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agent = agents.Agent(name="forecaster", instructions="Use the tool.", model="fake-model", tools=[get_weather])

    async def scenario() -> tuple[str, str]:
        result = await agents.Runner.run(agent, "Weather in Paris?")
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?", auto_previous_response_id=True)
        async for _ in streamed.stream_events():
            pass
        return result.final_output, streamed.final_output

    assert asyncio.run(scenario()) == ("It is sunny in Paris.", "It is sunny in Paris.")
