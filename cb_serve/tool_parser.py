"""Tool calls out of generated text, as it streams: ``<tool_call>`` blocks (``tool_format.py``)
become calls; everything else stays content. What a block holds is the family's format:

- ``hermes`` (Hermes, Qwen2.5, Qwen3, SmolLM3, and the built-in prompt): JSON,
  ``{"name": ..., "arguments": {...}}`` (or a list of calls, as SmolLM2 was trained to write);
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): XML, ``<function=NAME><parameter=KEY>value</parameter>...
  </function>``, each value typed by the tool's parameter schema (a string stays as written);
- ``llama3_json`` (Llama 3.1 to 3.3): the whole reply is ``{"name": ..., "parameters": {...}}``.

The format is chosen from the model's chat template (``tool_call_parser_for_template``) unless the
``tool_call_parser`` engine argument names one (vLLM's flag). A block that does not parse stays
content, as vLLM's parsers leave it; a JSON block is read by every parser (what a forced call's
grammar writes)."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from cb_serve.tool_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


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
    except ValueError:
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


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Feed text as it comes; each call returns (content to send now, calls completed now). The Hermes
    format; subclasses read other block bodies (``parse_block``). ``tools``: the request's tools (OpenAI's
    shape), for formats whose values are typed by the schema."""

    name = "hermes"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self.calls: list[ParsedToolCall] = []
        self._pending = ""  # held back: a possible tag start, or an open block
        self._in_block = False

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self._pending += text
        content, found = [], []
        while True:
            if not self._in_block:
                start = self._pending.find(TOOL_CALL_OPEN)
                if start < 0 and self.calls and not self._pending.strip():
                    break  # whitespace after a call: content only if more text follows
                if start < 0:
                    keep = _partial_suffix(self._pending, TOOL_CALL_OPEN)
                    content.append(self._content(self._pending[: len(self._pending) - keep]))
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                content.append(self._content(self._pending[:start]))
                self._pending = self._pending[start:]
                self._in_block = True
            end = self._pending.find(TOOL_CALL_CLOSE)
            if end < 0:
                break
            block = self._pending[: end + len(TOOL_CALL_CLOSE)]
            self._pending = self._pending[len(block) :]
            self._in_block = False
            calls = self.parse_block(block[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)])
            if calls is None:
                content.append(block)
            else:
                found += calls
                self.calls += calls
        return "".join(content), found

    def parse_block(self, body: str) -> list[ParsedToolCall] | None:
        """The calls one block holds, or None (it stays content)."""
        return parse_calls(body)

    def finish(self) -> str:
        """Content still held back (an unclosed block stays text)."""
        rest, self._pending, self._in_block = self._pending, "", False
        return self._content(rest)

    def _content(self, text: str) -> str:
        # Between and after calls, only the newlines that separate blocks: not content.
        return "" if self.calls and not text.strip() else text


FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's value as written in XML: a string where the schema says so (or the text is no JSON
    value), else the JSON value it spells (the template writes ``True`` / ``False`` as Python does)."""
    if schema is not None and schema.get("type") == "string":
        return text
    try:
        return json.loads({"True": "true", "False": "false", "None": "null"}.get(text, text))
    except ValueError:
        return text


class Qwen3CoderToolParser(ToolCallParser):
    """``<tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n</function>\n</tool_call>``
    (Qwen3-Coder's and Qwen3.5's templates): one call per block, one newline around each value trimmed."""

    name = "qwen3_coder"

    def parse_block(self, body: str) -> list[ParsedToolCall] | None:
        body = body.strip()
        if not body.startswith("<function="):
            return parse_calls(body)
        match = FUNCTION.fullmatch(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        properties = self._properties(name)
        arguments = {}
        for key, value in PARAMETER.findall(inner):
            key = key.strip()
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed_value(value, properties.get(key))
        if PARAMETER.sub("", inner).strip():  # text outside the parameters: not a call
            return None
        return [ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))]

    def _properties(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            function = tool.get("function", tool)
            if function.get("name") == name:
                return (function.get("parameters") or {}).get("properties") or {}
        return {}


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.x's JSON calls: the reply is ``{"name": NAME, "parameters": {...}}`` (the ``<|python_tag|>``
    that may precede it is a special token, gone from the text), several separated by ``;``. A reply that
    starts with ``{`` is held back until it ends and read whole (text if it is no call); any other reply
    is content, its ``<tool_call>`` blocks read as Hermes ones (what a forced call's grammar writes)."""

    name = "llama3_json"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._json: bool | None = None  # undecided until the reply's first character that is not a space
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        if self._json is None:
            self._held += text
            start = self._held.lstrip()
            if not start:
                return "", []
            self._json = start.startswith("{")
            text, self._held = self._held, ""
        if self._json:
            self._held += text
            return "", []
        return super().feed(text)

    def finish(self) -> str:
        held, self._held = self._held, ""
        if not self._json:
            return held + super().finish()
        calls = json_calls(held)
        if calls is None:
            return held
        self.calls += calls
        return ""


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
        except ValueError:
            return None
        found = calls_of(value)
        if found is None:
            return None
        calls += found


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": ToolCallParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def tool_call_parser_for_template(template: str | dict[str, str] | None) -> str:
    """The tool-call format a chat template writes calls in (its markers); ``hermes`` by default (the
    built-in tool prompt for a template without tools writes it too)."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    if any("<function=" in t and "<parameter=" in t for t in texts):
        return "qwen3_coder"
    if any("<|start_header_id|>" in t and '"parameters": ' in t for t in texts):  # Llama 3.1 / 3.2 / 3.3
        return "llama3_json"
    return "hermes"
