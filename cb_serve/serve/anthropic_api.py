"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the
chat path, as a ``ChatFrontend``.

Mapping to Chat Completions (``to_chat``): ``system`` and text blocks become messages (a turn's
text blocks joined with a newline); ``tool_result`` blocks become ``tool`` messages in order (an
``is_error`` result's text is prefixed ``Error: ``); ``tool_use`` blocks become the assistant
message's ``tool_calls``; thinking blocks of the history are dropped. A final assistant message is
a prefill: chat's ``continue_final_message``. ``tool_choice`` ``auto`` / ``any`` / ``tool`` /
``none`` are chat's ``auto`` / ``required`` / named / ``none``, and ``disable_parallel_tool_use``
is ``parallel_tool_calls: false``. ``thinking`` ``enabled`` or ``adaptive`` is chat's
``reasoning_effort`` (the template's thinking switch; a 400 for a model without one), at
``output_config.effort`` (``xhigh`` and ``max`` as ``high``; default ``high``, as Anthropic's);
without thinking, ``effort`` is ignored. ``disabled`` sets the template's ``enable_thinking`` to
false (nothing for a template without it). ``budget_tokens`` is validated as Anthropic's but not
enforced: thinking tokens count towards ``max_tokens``, as in Anthropic's API.
``output_config.format`` is chat's ``response_format`` (json_schema), ``metadata.user_id`` its
``user``. Usage is Anthropic's: ``input_tokens`` excludes the tokens read from the prefix cache
(``cache_read_input_tokens``).

Refused with a 400 naming the part (``unsupported()``, raised by ``to_chat`` too): content blocks
other than text, image, tool_use, tool_result and thinking (documents, ...), server tools,
``input_examples``, ``container``, ``mcp_servers`` and ``diagnostics``. Accepted and ignored:
``cache_control`` (prefix caching is automatic), ``service_tier``, ``speed``, ``inference_geo``,
``thinking.display``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from cb_serve import InvalidRequestError, ParsedToolCall
from cb_serve.serve.anthropic_protocol import (
    ClientTool,
    ConversationRequest,
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from cb_serve.serve.api_error import APIError
from cb_serve.serve.frontend_base import ChatFrontend, ChoiceDelta, ChoiceResult, ResponseContext, UsageInfo

JOIN = "\n"  # between the text blocks of one turn
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
# Anthropic's error types by cb-serve's (and by status, for the others).
ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "unsupported": "invalid_request_error",
    "conflict_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "overloaded_error": "overloaded_error",
    "service_unavailable": "overloaded_error",
    "internal_error": "api_error",
    "api_error": "api_error",
}
STATUS_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def _joined(content: str | list[Any]) -> str:
    """A string, or the text of text blocks joined."""
    return content if isinstance(content, str) else JOIN.join(b.text for b in content if isinstance(b, TextBlock))


def _misplaced(where: str, kind: str, role: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {kind} blocks are not allowed in {role} messages.", where)


def _user_turn(i: int, message: Message) -> list[dict[str, Any]]:
    """A user turn: runs of text and image blocks as user messages (images as ``image_url`` parts), tool
    results as tool messages, in order."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    run: list[TextBlock | ImageBlock] = []
    for j, block in enumerate(message.content):
        if isinstance(block, (TextBlock, ImageBlock)):
            run.append(block)
        elif isinstance(block, ToolResultBlock):
            if run:
                out.append(_user_message(run))
                run = []
            result = ("Error: " if block.is_error else "") + _joined(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
        else:
            raise _misplaced(f"messages.{i}.content.{j}", block.type, "user")
    if run or not out:
        out.append(_user_message(run))
    return out


def _user_message(run: list[TextBlock | ImageBlock]) -> dict[str, Any]:
    """Text blocks joined; with images, OpenAI content parts in the blocks' order."""
    if not any(isinstance(b, ImageBlock) for b in run):
        return {"role": "user", "content": JOIN.join(b.text for b in run)}
    parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlock)
             else {"type": "image_url", "image_url": {"url": b.url()}} for b in run]  # fmt: skip
    return {"role": "user", "content": parts}


def _assistant_turn(i: int, message: Message) -> dict[str, Any]:
    """An assistant turn: its text as content, its tool_use blocks as tool_calls; thinking dropped."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            raise _misplaced(f"messages.{i}.content.{j}", block.type, "assistant")
    turn: dict[str, Any] = {"role": "assistant", "content": JOIN.join(text) if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def chat_messages(body: ConversationRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt first."""
    out = [{"role": "system", "content": _joined(body.system)}] if body.system is not None else []
    for i, message in enumerate(body.messages):
        if message.role == "user":
            out += _user_turn(i, message)
        elif message.role == "assistant":
            out.append(_assistant_turn(i, message))
        else:
            blocks = message.content if isinstance(message.content, list) else []
            for j, block in enumerate(blocks):
                if not isinstance(block, TextBlock):
                    raise _misplaced(f"messages.{i}.content.{j}", block.type, "system")
            out.append({"role": "system", "content": _joined(message.content)})
    return out


def chat_tools(body: ConversationRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request."""
    out: dict[str, Any] = {}
    tools = [t for t in body.tools or () if isinstance(t, ClientTool)]  # server tools: refused before
    if tools:
        out["tools"] = [{"type": "function", "function": _function(t)} for t in tools]
    choice = body.tool_choice
    if choice is None:
        return out
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    if choice.type == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice.type != "auto" or tools:  # auto without tools: nothing to choose (chat would refuse it)
        out["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
    return out


def _function(tool: ClientTool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return {k: v for k, v in {**function, "strict": tool.strict}.items() if v is not None}


def chat_options(body: ConversationRequest) -> dict[str, Any]:
    """``chat_template_kwargs``, ``reasoning_effort`` and ``response_format`` of the chat request."""
    out: dict[str, Any] = {}
    config = body.output_config
    if body.thinking is not None and body.thinking.type != "disabled":  # the template's switch, or a 400
        out["reasoning_effort"] = EFFORTS[config.effort or "high"] if config is not None else "high"
    elif body.thinking is not None:  # harmless to a template without the switch (a model that cannot think)
        out["chat_template_kwargs"] = {"enable_thinking": False}
    if config is not None and config.format is not None:
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": config.format.schema_},
        }
    return out


def check_supported(body: ConversationRequest) -> None:
    """Raises ``InvalidRequestError`` naming the first part cb-serve cannot serve."""
    for param, what in body.unsupported():
        raise InvalidRequestError(f"Unsupported parameter {param!r}: cb-serve does not implement {what}.", param)


def conversation_to_chat(body: ConversationRequest) -> dict[str, Any]:
    """The prompt part of a chat request (messages, tools, template options) and its model."""
    check_supported(body)
    messages = chat_messages(body)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, **chat_tools(body), **chat_options(body)}
    if messages[-1]["role"] == "assistant":  # prefill: the model continues that turn
        chat.update(add_generation_prompt=False, continue_final_message=True)
    return chat


def messages_to_chat(body: MessagesRequest) -> dict[str, Any]:
    """A Messages request as a Chat Completions request (a dict for ``ChatCompletionRequest``)."""
    chat = conversation_to_chat(body)
    chat.update(max_tokens=body.max_tokens, stream=body.stream)
    sampling = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences}
    chat.update({k: v for k, v in sampling.items() if v is not None})
    if body.metadata is not None and body.metadata.user_id is not None:
        chat["user"] = body.metadata.user_id
    return chat


def message_id(ctx: ResponseContext) -> str:
    """The response's ``msg_`` id: the request id (the router's ``msg-<hex>`` as ``msg_<hex>``)."""
    return ctx.id if ctx.id.startswith("msg_") else "msg_" + ctx.id.removeprefix("msg-")


def tool_use_id(call: ParsedToolCall) -> str:
    """Anthropic's ``toolu_`` id for a call (the same in a whole response and a stream)."""
    return call.id if call.id.startswith("toolu_") else "toolu_" + call.id.removeprefix("call_")


def tool_use_block(call: ParsedToolCall, whole: bool = True) -> dict[str, Any]:
    """The ``tool_use`` block of a call (a stream's block starts with an empty ``input``)."""
    arguments = json.loads(call.arguments) if whole else {}
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": arguments}


def stop_fields(finish_reason: str | None, stop_reason: int | str | None, called: bool) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence``: None for an aborted or failed choice."""
    if finish_reason == "length":
        reason = "max_tokens"
    elif finish_reason == "tool_calls" or (finish_reason == "stop" and called):
        reason = "tool_use"
    elif finish_reason == "stop":
        reason = "stop_sequence" if isinstance(stop_reason, str) else "end_turn"
    else:
        reason = None
    return {"stop_reason": reason, "stop_sequence": stop_reason if reason == "stop_sequence" else None}


def usage_body(usage: UsageInfo) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` without the cached tokens, which are ``cache_read_input_tokens``."""
    body: dict[str, Any] = {
        "input_tokens": max(usage.prompt_tokens - usage.cached_tokens, 0),
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }
    if usage.reasoning_tokens:
        body["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
    return body


def sse(data: dict[str, Any]) -> str:
    """One server-sent event named after its ``type``."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def error_object(status: int, type_: str, message: str) -> dict[str, Any]:
    """Anthropic's error object (also the data of a stream's ``error`` event)."""
    kind = "request_too_large" if status == 413 else ERROR_TYPES.get(type_) or STATUS_TYPES.get(status)
    kind = kind or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Blocks:
    """A stream's content blocks as deltas arrive: a thinking or text block stays open while its
    kind of delta continues; each tool call is a whole ``tool_use`` block (one ``input_json_delta``)."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "thinking" | "text"
        self.called = False

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.open = kind
        events.append(sse({"type": "content_block_start", "index": self.count, "content_block": block}))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open, self.count = None, self.count + 1
        return [sse({"type": "content_block_stop", "index": self.count - 1})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.count, "delta": delta})

    def feed(self, delta: ChoiceDelta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            self.called = True
            events += self._start("tool_use", tool_use_block(call, whole=False))
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            events += self.close()
        return events


class MessagesFrontend(ChatFrontend):
    """Anthropic's Messages API. Besides ``ChatFrontend``: ``count_path``, ``count_request_model``,
    ``count_to_chat`` and ``count_response`` for ``POST /v1/messages/count_tokens``."""

    path = "/v1/messages"
    request_model = MessagesRequest
    count_path = "/v1/messages/count_tokens"
    count_request_model = CountTokensRequest

    def to_chat(self, body: BaseModel) -> dict[str, Any]:
        assert isinstance(body, MessagesRequest)
        return messages_to_chat(body)

    def count_to_chat(self, body: BaseModel) -> dict[str, Any]:
        """A count_tokens body as a chat request whose rendered prompt is what is counted."""
        assert isinstance(body, CountTokensRequest)
        return conversation_to_chat(body)

    def count_response(self, input_tokens: int) -> dict[str, Any]:
        return {"input_tokens": input_tokens}

    def _message(self, ctx: ResponseContext, content: list[dict[str, Any]], usage: UsageInfo) -> dict[str, Any]:
        return {"id": message_id(ctx), "type": "message", "role": "assistant", "model": ctx.model,
                "content": content, "stop_reason": None, "stop_sequence": None, "usage": usage_body(usage)}  # fmt: skip

    def response(self, ctx: ResponseContext, body: BaseModel, choice: ChoiceResult, usage: UsageInfo) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if choice.reasoning:
            content.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
        if choice.content:
            content.append({"type": "text", "text": choice.content})
        content += [tool_use_block(call) for call in choice.tool_calls]
        message = self._message(ctx, content, usage)
        return {**message, **stop_fields(choice.finish_reason, choice.stop_reason, bool(choice.tool_calls))}

    async def events(
        self, ctx: ResponseContext, body: BaseModel, deltas: AsyncIterator[ChoiceDelta], usage: UsageInfo
    ) -> AsyncIterator[str]:
        """``message_start`` once the first delta came (its usage then has the prompt's tokens),
        the content blocks, ``message_delta`` and ``message_stop``; a failure: an ``error`` event."""
        blocks, started = _Blocks(), False
        finish: tuple[str | None, int | str | None] = (None, None)
        try:
            async for delta in deltas:
                if not started:
                    started = True
                    yield sse({"type": "message_start", "message": self._message(ctx, [], _no_output(usage))})
                for event in blocks.feed(delta):
                    yield event
                if delta.finish_reason is not None:
                    finish = (delta.finish_reason, delta.stop_reason)
        except APIError as e:
            yield sse(error_object(e.status, e.type, e.message))
            return
        if not started:
            yield sse({"type": "message_start", "message": self._message(ctx, [], _no_output(usage))})
        for event in blocks.close():
            yield event
        stop = stop_fields(*finish, blocks.called)
        delta_usage = {k: v for k, v in usage_body(usage).items() if k != "cache_creation_input_tokens"}
        yield sse({"type": "message_delta", "delta": stop, "usage": delta_usage})
        yield sse({"type": "message_stop"})

    def error_body(self, status: int, type_: str, message: str, param: str | None) -> dict[str, Any]:
        return error_object(status, type_, message)


def _no_output(usage: UsageInfo) -> UsageInfo:
    return UsageInfo(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens)
