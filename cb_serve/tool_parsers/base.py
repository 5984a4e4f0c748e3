"""The tool-call parser's interface and the Hermes format: ``<tool_call>`` blocks (``tool_format.py``) holding
``{"name": ..., "arguments": {...}}`` (or a list of calls) become calls; everything else stays content. Other
formats subclass ``ToolCallParser``; the JSON readers here are shared by them."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cb_serve.structured_outputs_params import StructuredOutputsParams
from cb_serve.text_stream import held_suffix
from cb_serve.tool_format import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    arguments_schema,
    lark_string,
    tool_call_constraint,
    tool_call_schema,
)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The ``tool_calls`` entry of a message, or of a stream delta when ``index`` is given."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_calls(body: str) -> list[ParsedToolCall] | None:
    """The calls in one block's JSON, or None when it holds none."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's depth
        return None
    return calls_of(value)


def calls_of(value: Any) -> list[ParsedToolCall] | None:
    """The calls a JSON value spells (a call, or a list of calls), or None."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(ParsedToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


class ToolCallParser:
    """Feed text as it comes; each call returns (content to send now, calls completed now). The Hermes
    format; subclasses read other block bodies (``parse_block``). ``tools``: the request's tools (OpenAI's
    shape), for formats whose values are typed by the schema."""

    name = "hermes"
    keeps_special_tokens = False  # the format's markers are special tokens (the request's text must keep them)
    blocks: tuple[tuple[str, str], ...] = ((TOOL_CALL_OPEN, TOOL_CALL_CLOSE),)  # (open, close) of each kind
    dropped: tuple[str, ...] = ()  # markers around the blocks that are neither content nor calls

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self.calls: list[ParsedToolCall] = []
        self._pending = ""  # held back: a possible tag start, or an open block
        self._in_block: tuple[str, str] | None = None
        self._tags = [*(pair[0] for pair in self.blocks), *self.dropped]

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self._pending += text
        content: list[str] = []
        found: list[ParsedToolCall] = []
        while True:
            if self._in_block is None:
                found_tags = ((self._pending.find(t), t) for t in self._tags if t in self._pending)
                start, tag = min(found_tags, default=(-1, ""))
                if start < 0 and self.calls and not self._pending.strip():
                    break  # whitespace after a call: content only if more text follows
                if start < 0:
                    keep = held_suffix(self._pending, self._tags)
                    content.append(self._content(self._pending[: len(self._pending) - keep]))
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                content.append(self._content(self._pending[:start]))
                self._pending = self._pending[start:]
                if tag in self.dropped:
                    self._pending = self._pending[len(tag) :]
                    continue
                self._in_block = next(pair for pair in self.blocks if pair[0] == tag)
            opened, close = self._in_block
            end = self._pending.find(close)
            if end < 0:
                break
            block = self._pending[: end + len(close)]
            self._pending = self._pending[len(block) :]
            self._in_block = None
            calls = self.parse_block(block[len(opened) : -len(close)], opened)
            if calls is None:
                content.append(block)
            else:
                found += calls
                self.calls += calls
        return "".join(content), found

    def parse_block(self, body: str, opened: str = TOOL_CALL_OPEN) -> list[ParsedToolCall] | None:
        """The calls one block holds (``opened``: its open tag), or None (it stays content)."""
        return parse_calls(body)

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool, template: str = "") -> StructuredOutputsParams:
        """The grammar of a forced call (``tool_choice`` required or named) in this format: one or more calls of
        ``tools`` (one unless ``parallel``), their arguments fitting each tool's schema, and nothing else.
        ``template``: the model's chat template, for a format with variants."""
        return tool_call_constraint(tools, parallel)

    def finish(self) -> str:
        """Content still held back (an unclosed block stays text)."""
        rest, self._pending, self._in_block = self._pending, "", None
        return self._content(rest)

    def _content(self, text: str) -> str:
        # Between and after calls, only the newlines that separate blocks: not content.
        return "" if self.calls and not text.strip() else text


def json_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls of JSON values separated by ``;`` (and spaces) that make up all of ``text``, or None."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or (calls and text[pos] == ";")):
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's depth
            return None
        found = calls_of(value)
        if found is None:
            return None
        calls += found


def per_tool_rules(
    tools: list[dict[str, Any]],
    parallel: bool,
    call_rule: Callable[[str, dict[str, Any]], str],
    separator: str = "",
    start: str = "start",
) -> str:
    """Lark rules (llguidance's dialect) of one call (several, joined by ``separator``, when ``parallel``), each
    a call of one of ``tools`` written by ``call_rule(name, arguments_schema)`` (a rule's body)."""
    rules = [f"c{i}: {call_rule(t['function']['name'], arguments_schema(t))}" for i, t in enumerate(tools)]
    repeat = (f" ({lark_string(separator)} call)*" if separator else " call*") if parallel else ""
    head = f"{start}: call{repeat}\ncall: " + " | ".join(f"c{i}" for i in range(len(tools)))
    return "\n".join([head, *rules]) + "\n"


def listed_calls(tools: list[dict[str, Any]], parallel: bool, arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of a list of calls (one unless ``parallel``)."""
    schema = tool_call_schema(tools, arguments_key)
    defs = schema.pop("$defs")
    return {"type": "array", "items": schema, "minItems": 1, **({} if parallel else {"maxItems": 1}), "$defs": defs}
