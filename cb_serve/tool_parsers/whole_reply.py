"""Formats whose calls are the whole reply: Llama 3.x's JSON and Granite 3.x's ``<|tool_call|>`` list."""

from __future__ import annotations

from typing import Any

from cb_serve.structured_outputs_params import StructuredOutputsParams
from cb_serve.tool_format import json_rule, special_token, tool_call_schema
from cb_serve.tool_parsers.base import ParsedToolCall, ToolCallParser, json_calls, listed_calls


class WholeReplyToolParser(ToolCallParser):
    """A format whose calls are the whole reply: a reply that opens like one (``opens``) is held back until
    it ends and read whole (``read_reply``; text if it is no call); any other reply is content, its
    ``<tool_call>`` blocks read as Hermes ones (what a forced call's grammar writes)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._whole: bool | None = None  # undecided until the reply's start shows whether it is a call
        self._held = ""

    def opens(self, start: str) -> bool | None:
        """Whether a reply starting with ``start`` (no leading space) is read whole; None: not known yet."""
        raise NotImplementedError

    def read_reply(self, text: str) -> list[ParsedToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        if self._whole is None:
            self._held += text
            start = self._held.lstrip()
            self._whole = self.opens(start) if start else None
            if self._whole is None:
                return "", []
            text, self._held = self._held, ""
        if self._whole:
            self._held += text
            return "", []
        return super().feed(text)

    def finish(self) -> str:
        held, self._held = self._held, ""
        if not self._whole:
            return (super().feed(held)[0] if held else "") + super().finish()
        calls = self.read_reply(held)
        if calls is None:
            return held
        self.calls += calls
        return ""


class Llama3JsonToolParser(WholeReplyToolParser):
    """Llama 3.x's JSON calls: the reply is ``{"name": NAME, "parameters": {...}}`` (the ``<|python_tag|>``
    that may precede it is a special token, gone from the text), several separated by ``;``."""

    name = "llama3_json"

    def opens(self, start: str) -> bool | None:
        return start.startswith("{")

    def read_reply(self, text: str) -> list[ParsedToolCall] | None:
        return json_calls(text)

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool, template: str = "") -> StructuredOutputsParams:
        """``{"name": ..., "parameters": {...}}``, calls separated by ``; ``."""
        repeat = ' ("; " call)*' if parallel else ""
        call = json_rule(tool_call_schema(tools, arguments_key="parameters"))
        return StructuredOutputsParams(grammar=f"start: call{repeat}\ncall: {call}\n")


GRANITE_CALLS = "<|tool_call|>"


class GraniteToolParser(WholeReplyToolParser):
    """Granite 3.x's calls: the reply is ``<|tool_call|>`` then a JSON list of ``{"name", "arguments"}`` (as its
    template's system prompt asks). The marker is a special token in Granite's tokenizers: without it the
    reply starts at the list, which is read the same. Granite 4 writes Hermes blocks."""

    name = "granite"

    def opens(self, start: str) -> bool | None:
        if start.startswith(GRANITE_CALLS) or start.startswith("["):
            return True
        return None if GRANITE_CALLS.startswith(start) else False

    def read_reply(self, text: str) -> list[ParsedToolCall] | None:
        body = text.strip().removeprefix(GRANITE_CALLS).strip()
        return json_calls(body) if body.startswith("[") else None

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool, template: str = "") -> StructuredOutputsParams:
        """``<|tool_call|>`` (its special token) and the JSON list."""
        listing = json_rule(listed_calls(tools, parallel))
        return StructuredOutputsParams(grammar=f"start: {special_token(GRANITE_CALLS)} calls\ncalls: {listing}\n")
