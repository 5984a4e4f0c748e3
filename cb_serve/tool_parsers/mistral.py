"""Mistral's calls after ``[TOOL_CALLS]``: a JSON list, or ``NAME[ARGS]{...}`` per call."""

from __future__ import annotations

import json
import re
from typing import Any

from cb_serve.structured_outputs_params import StructuredOutputsParams
from cb_serve.text_stream import held_suffix
from cb_serve.tool_format import json_rule, lark_string, special_token
from cb_serve.tool_parsers.base import (
    ParsedToolCall,
    ToolCallParser,
    json_calls,
    listed_calls,
    per_tool_rules,
)

MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
MISTRAL_CALL = re.compile(r"([\w.\-]+)(?:\[CALL_ID\][\w\-]+)?(?:\[ARGS\])?(\{.*\})", re.DOTALL)


class MistralToolParser(ToolCallParser):
    """Mistral's calls, each after the ``[TOOL_CALLS]`` special token (kept in the text for this parser:
    ``keeps_special_tokens``): a JSON list of ``{"name", "arguments"}`` (v3 to v7 tokenizers, the Mistral
    Small 3.1 template), or ``NAME[ARGS]{...}`` (v11 and later: Mistral Small 3.2, Magistral, Ministral 3,
    Devstral; ``[CALL_ID]ID`` may follow the name, and older v11 models omit ``[ARGS]``). The text before the
    first marker is content (its ``<tool_call>`` blocks read as Hermes ones: what a forced call's grammar
    writes); after it, each call is read when the next marker or the reply's end closes it. A call that does
    not parse comes back as text, its marker with it."""

    name = "mistral"
    keeps_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._held = ""  # before the first marker: an end of the text that may begin it
        self._calls_text: str | None = None  # from the first marker on: the text of the call not yet closed

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        content, found = "", []
        if self._calls_text is None:
            held = self._held + text
            start = held.find(MISTRAL_CALLS)
            if start < 0:
                keep = held_suffix(held, (MISTRAL_CALLS,))
                self._held = held[len(held) - keep :]
                return super().feed(held[: len(held) - keep])
            self._held, self._calls_text = "", ""
            content, found = super().feed(held[:start])
            content += super().finish()
            text = held[start:]
        self._calls_text += text
        *complete, self._calls_text = self._segments(self._calls_text)
        return self._read(complete, content, found)

    @staticmethod
    def _segments(text: str) -> list[str]:
        """``text`` (which starts with a marker) cut before each marker: every piece but the last is closed."""
        return [MISTRAL_CALLS + piece for piece in text.split(MISTRAL_CALLS)[1:]]

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool, template: str = "") -> StructuredOutputsParams:
        """``[TOOL_CALLS]NAME[ARGS]{...}`` per call, or, for a template that writes the older JSON list (no
        ``[ARGS]``), ``[TOOL_CALLS] [...]``; the markers as their special tokens."""
        if template and MISTRAL_ARGS not in template:
            listing = json_rule(listed_calls(tools, parallel))
            return StructuredOutputsParams(
                grammar=f'start: {special_token(MISTRAL_CALLS)} " " calls\ncalls: {listing}\n'
            )

        def call(name: str, schema: dict[str, Any]) -> str:
            return (
                f"{special_token(MISTRAL_CALLS)} {lark_string(name)} {special_token(MISTRAL_ARGS)} {json_rule(schema)}"
            )

        return StructuredOutputsParams(grammar=per_tool_rules(tools, parallel, call))

    def _read(self, segments: list[str], content: str, found: list[ParsedToolCall]) -> tuple[str, list]:
        for segment in segments:
            calls = mistral_calls(segment[len(MISTRAL_CALLS) :])
            if calls is None:
                content += segment
            else:
                found += calls
                self.calls += calls
        return content, found

    def finish(self) -> str:
        if self._calls_text is None:
            held, self._held = self._held, ""
            return super().feed(held)[0] + super().finish()
        rest, self._calls_text = self._calls_text, None
        return self._read([rest] if rest else [], "", [])[0]


def mistral_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls after one ``[TOOL_CALLS]`` marker: a JSON list (or object), or ``NAME[ARGS]{...}``; None."""
    text = text.strip()
    if text.startswith(("[", "{")):
        return json_calls(text)
    match = MISTRAL_CALL.fullmatch(text)
    if match is None:
        return None
    try:
        arguments = json.loads(match.group(2))
    except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's depth
        return None
    if not isinstance(arguments, dict):
        return None
    return [ParsedToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False))]
