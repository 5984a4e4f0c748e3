"""The interface every chat-shaped HTTP API implements over one generation path.

OpenAI's Chat Completions, OpenAI's Responses and Anthropic's Messages are the same request to
the engine: a conversation, tools, sampling fields. Each API is a ``ChatFrontend``: it turns its
body into a ``ChatCompletionRequest`` (``to_chat``), and turns the neutral outputs back into its
own shapes: ``ChoiceDelta`` per chunk (content, reasoning and tool calls already split apart by the
router) for a stream, ``ChoiceResult`` for a whole response. The router owns everything between:
validation of the chat request, the chat template, routing, retries and cancellation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from cb_serve import ParsedToolCall


@dataclass
class ChoiceDelta:
    """What one engine chunk added to choice ``index``: visible text, reasoning text (between the
    model's think tags, with a reasoning parser configured) and the tool calls completed in it.
    ``finish_reason`` is set on the choice's last delta: stop, length, tool_calls, abort or error."""

    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ChoiceResult:
    """A whole choice: ``content`` is None when the model only called tools."""

    index: int
    content: str | None
    reasoning: str | None
    tool_calls: list[ParsedToolCall]
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class UsageInfo:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class ResponseContext:
    """What every body of one response shares."""

    id: str  # the request id (the router's, or the client's x-request-id)
    created: int  # unix seconds
    model: str  # the served model name (or the LoRA adapter's)


class ChatFrontend(ABC):
    """One HTTP API over the chat path (``router.py`` mounts each at its ``path``)."""

    path: str  # e.g. "/v1/messages"
    request_model: type[BaseModel]  # the API's body, validated strictly (unknown fields: 400)

    @abstractmethod
    def to_chat(self, body: BaseModel) -> dict[str, Any]:
        """The body as a Chat Completions request (a dict for ``ChatCompletionRequest``); raises
        ``InvalidRequestError`` (a 400 naming the parameter) for what cannot be served."""

    @abstractmethod
    def response(self, ctx: ResponseContext, body: BaseModel, choice: ChoiceResult, usage: UsageInfo) -> dict[str, Any]:
        """The whole (non-streamed) response body."""

    @abstractmethod
    def events(
        self, ctx: ResponseContext, body: BaseModel, deltas: AsyncIterator[ChoiceDelta], usage: UsageInfo
    ) -> AsyncIterator[str]:
        """The stream as server-sent-event text (each item one whole event, ``event:``/``data:``
        lines and the blank line). ``usage`` is filled in as the deltas arrive (complete once they
        end). A failure mid-stream arrives as an ``APIError`` raised by ``deltas``: send it in-band
        (``error_event``) and end the stream."""

    @abstractmethod
    def error_body(self, status: int, type_: str, message: str, param: str | None) -> dict[str, Any]:
        """This API's error object (the router sends it with ``status``)."""
