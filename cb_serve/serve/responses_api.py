"""OpenAI's Responses API (``POST /v1/responses``) over the chat path, as a ``ChatFrontend``.

Shapes as the ``openai`` package's ``types/responses`` spell them. ``to_chat``: ``instructions`` become
a system message first; input items become chat messages (a ``function_call`` joins the assistant
message before it, so consecutive calls are one message with ``tool_calls`` whose ids are the
``call_id``s; a ``function_call_output`` is a ``tool`` message; ``reasoning`` items are dropped); function
tools become chat tools, ``text.format`` ``response_format``, ``max_output_tokens`` ``max_tokens``,
``reasoning.effort`` ``reasoning_effort``. The output: a ``reasoning`` item, a ``message`` and one
``function_call`` item per call, whole or as the Responses stream events.

``previous_response_id`` continues a response stored on this router replica (``response_store.py``:
in memory, LRU, at most ``max_stored`` responses and ``max_stored_bytes`` bytes; an unknown or
evicted id is a 404); the previous ``instructions`` are not carried over, as OpenAI documents.

Refused (a 400 naming the parameter): built-in tools (web_search, file_search, mcp, ...) and their
tool choices, files and audio (images: ``input_image`` with an ``image_url``), item types other than messages, function
calls and their outputs, and reasoning, ``truncation: "auto"``, ``background``, ``conversation``,
``prompt``, ``context_management``, and logprobs (``top_logprobs`` > 0,
``include: ["message.output_text.logprobs"]``): the chat path's deltas carry no logprobs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, PrivateAttr, Tag, model_validator

from cb_serve import InvalidRequestError
from cb_serve.serve.api_error import APIError
from cb_serve.serve.frontend_base import ChatFrontend, ChoiceDelta, ChoiceResult, ResponseContext, UsageInfo
from cb_serve.serve.protocol import MAX_TOOLS, Strict, error_body
from cb_serve.serve.response_store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    InputItem,
    Other,
    Output,
    ResponseStore,
    input_messages,
    new_id,
    output_message,
    parts_unsupported,
    tagger,
)

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}
Includable = Literal[
    "file_search_call.results",  # these concern items cb-serve never makes: accepted, nothing changes
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",  # reasoning comes as plain text; encrypted_content stays null
    "message.output_text.logprobs",  # refused (see unsupported())
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[Other, Tag("other")], Discriminator(tagger(("function",)))
]


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # passed on: the chat path refuses it


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: the reasoning comes whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # accepted: no obfuscation field is sent


class ResponsesRequest(Strict):
    """``POST /v1/responses`` (``openai.types.responses.response_create_params``)."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: (
        Annotated[Literal["none", "auto", "required"] | ToolChoiceFunction | Other, Field(union_mode="left_to_right")]
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None  # counts built-in tool calls only: none here
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Includable] | None = None
    background: bool | None = None
    # Declared only to refuse them (see unsupported()).
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    _conversation: list[dict[str, Any]] | None = PrivateAttr(None)  # set by to_chat: what a stored response keeps

    def remember(self, conversation: list[dict[str, Any]]) -> None:
        """The conversation ``to_chat`` resolved (history and input): what a stored response keeps."""
        self._conversation = conversation

    @property
    def resolved_conversation(self) -> list[dict[str, Any]] | None:
        return self._conversation

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each part that asks for something not implemented."""
        out = []
        for i, item in enumerate(self.input if isinstance(self.input, list) else []):
            if isinstance(item, Other):
                out.append((f"input.{i}", f"input items of type {item.type!r}"))
            why = parts_unsupported(getattr(item, "content", getattr(item, "output", "")))
            if why:
                out.append((f"input.{i}", why))
        for i, tool in enumerate(self.tools or ()):
            if isinstance(tool, Other):
                out.append((f"tools.{i}", f"{tool.type} tools (function tools only)"))
        if isinstance(self.tool_choice, Other):
            out.append(("tool_choice", f"tool_choice of type {self.tool_choice.type!r}"))
        if self.truncation == "auto":
            out.append(("truncation", "truncation 'auto' (dropping input that exceeds the context)"))
        if self.background:
            out.append(("background", "background responses"))
        if self.top_logprobs or "message.output_text.logprobs" in (self.include or ()):
            out.append(("top_logprobs" if self.top_logprobs else "include", "logprobs in the Responses API"))
        for name in ("conversation", "prompt", "context_management"):
            if getattr(self, name) is not None:
                out.append((name, name.replace("_", " ")))
        return out


def chat_options(body: ResponsesRequest) -> dict[str, Any]:
    """Everything of the chat request but its messages, the fields not given left out."""
    fmt = body.text.format if body.text is not None else None
    response_format: dict[str, Any] | None = {"type": fmt.type} if fmt is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        response_format = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
    choice: Any = body.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in body.tools or []
    ]
    options = {
        "model": body.model,
        "stream": body.stream,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "verbosity": body.text.verbosity if body.text is not None else None,
        "metadata": body.metadata,
        **{name: getattr(body, name) for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier")},
    }
    return {k: v for k, v in options.items() if v is not None}


def usage_body(usage: UsageInfo) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def status_of(finish_reason: str | None) -> str:
    """The response's status for the choice's finish reason."""
    return {"length": "incomplete", "abort": "cancelled", "error": "failed"}.get(finish_reason or "", "completed")


def failure(status: int, type_: str, message: str, param: str | None) -> dict[str, Any]:
    """A failed response's ``error`` (its ``code`` one of the client's literals)."""
    code = "invalid_prompt" if 400 <= status < 500 else "server_error"
    return {"code": code, "message": message, "type": type_, "param": param}


class ResponsesFrontend(ChatFrontend):
    """OpenAI's Responses API; one instance per router replica holds its stored responses."""

    path = "/v1/responses"
    request_model = ResponsesRequest

    def __init__(self, max_stored: int = DEFAULT_MAX_ENTRIES, max_stored_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.store = ResponseStore(max_stored, max_stored_bytes)

    def history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The stored conversation a request continues (404 when it is not stored here)."""
        if previous_response_id is None:
            return []
        conversation = self.store.get(previous_response_id)
        if conversation is None:
            raise APIError(
                404,
                f"Previous response {previous_response_id[:80]!r} not found on this server: responses are kept "
                f"in memory per router replica, at most {self.store.max_entries} of them and "
                f"{self.store.max_bytes} bytes, and only with store: true.",
                param="previous_response_id",
            )
        return conversation

    def to_chat(self, body: BaseModel) -> dict[str, Any]:
        assert isinstance(body, ResponsesRequest)
        for param, what in body.unsupported():
            raise InvalidRequestError(f"Unsupported parameter {param!r}: cb-serve does not implement {what}.", param)
        conversation = self.history(body.previous_response_id) + input_messages(body.input)
        if not conversation:
            raise InvalidRequestError("input is required (or previous_response_id).", "input")
        body.remember(conversation)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        return {"messages": system + conversation, **chat_options(body)}

    def _keep(self, response_id: str, body: ResponsesRequest, status: str, output: list[dict[str, Any]]) -> None:
        if body.store is False or status not in ("completed", "incomplete"):
            return
        conversation = body.resolved_conversation
        if conversation is None:  # to_chat ran on another instance of the body
            try:
                conversation = self.history(body.previous_response_id) + input_messages(body.input)
            except APIError:
                return
        self.store.put(response_id, [*conversation, output_message(output)])

    def _body(self, ctx: ResponseContext, body: ResponsesRequest, **fields: Any) -> dict[str, Any]:
        """The Response object: ``fields`` (id, status, output, usage, error) and the request echoed."""
        status, choice, text = fields["status"], body.tool_choice or "auto", body.text or TextConfig()
        fmt = text.format.model_dump(by_alias=True, exclude_none=True) if text.format else {"type": "text"}
        return {
            "id": fields["id"],
            "object": "response",
            "created_at": ctx.created,
            "completed_at": time.time() if status == "completed" else None,
            "model": ctx.model,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": None,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in body.tools or []],
            "text": {"format": fmt, "verbosity": text.verbosity},
            "reasoning": (body.reasoning or ReasoningConfig()).model_dump(exclude={"generate_summary"}),
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "previous_response_id": body.previous_response_id,
            "store": body.store is not False,
            "background": False,
            "truncation": "disabled",
            "service_tier": "default",
            "top_logprobs": body.top_logprobs or 0,
            **{
                name: getattr(body, name)
                for name in ("user", "prompt_cache_key", "prompt_cache_retention", "safety_identifier")
            },
            **fields,
        }

    def _done(
        self,
        ctx: ResponseContext,
        body: ResponsesRequest,
        response_id: str,
        out: Output,
        finish: str | None,
        usage: UsageInfo,
    ) -> tuple[list[str], dict[str, Any]]:
        """Ends the output (its last events) and keeps the conversation; the final Response object."""
        status = status_of(finish)
        events = out.end(status)
        self._keep(response_id, body, status, out.items)
        error = failure(500, "internal_error", "The generation failed.", None) if status == "failed" else None
        response = self._body(ctx, body, id=response_id, status=status, output=out.items, usage=usage_body(usage))
        return events, {**response, "error": error}

    def response(self, ctx: ResponseContext, body: BaseModel, choice: ChoiceResult, usage: UsageInfo) -> dict[str, Any]:
        assert isinstance(body, ResponsesRequest)
        out = Output()
        out.reasoning(choice.reasoning or "")
        out.content(choice.content or "")
        out.calls(choice.tool_calls)
        return self._done(ctx, body, new_id("resp"), out, choice.finish_reason, usage)[1]

    async def events(
        self, ctx: ResponseContext, body: BaseModel, deltas: AsyncIterator[ChoiceDelta], usage: UsageInfo
    ) -> AsyncIterator[str]:
        """``response.created`` and ``response.in_progress``, the items' events, then
        ``response.completed`` (or ``.incomplete``); a failure mid-stream: ``response.failed``."""
        assert isinstance(body, ResponsesRequest)
        out, response_id, finish = Output(), new_id("resp"), None
        started = self._body(ctx, body, id=response_id, status="in_progress", output=[])
        yield out.event("response.created", response=started)
        yield out.event("response.in_progress", response=started)
        try:
            async for delta in deltas:
                for event in out.reasoning(delta.reasoning) + out.content(delta.content) + out.calls(delta.tool_calls):
                    yield event
                finish = delta.finish_reason or finish
        except APIError as e:
            for event in out.close("incomplete"):
                yield event
            failed = self._body(ctx, body, id=response_id, status="failed", output=out.items, usage=usage_body(usage))
            yield out.event(
                "response.failed", response={**failed, "error": failure(e.status, e.type, e.message, e.param)}
            )
            return
        events, response = self._done(ctx, body, response_id, out, finish, usage)
        for event in events:
            yield event
        yield out.event(TERMINAL.get(response["status"], "response.incomplete"), response=response)

    def error_body(self, status: int, type_: str, message: str, param: str | None) -> dict[str, Any]:
        return error_body(message, type_, status, param)
