"""Tool calls out of generated text, as it streams: ``<tool_call>`` blocks (``tool_format.py``)
become calls; everything else stays content. A block whose JSON is not a call (or a list of calls,
as SmolLM2 was trained to write) stays content too, as vLLM's Hermes parser does."""

from __future__ import annotations

import json
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
    """Feed text as it comes; each call returns (content to send now, calls completed now)."""

    def __init__(self) -> None:
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
            calls = parse_calls(block[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)])
            if calls is None:
                content.append(block)
            else:
                found += calls
                self.calls += calls
        return "".join(content), found

    def finish(self) -> str:
        """Content still held back (an unclosed block stays text)."""
        rest, self._pending, self._in_block = self._pending, "", False
        return self._content(rest)

    def _content(self, text: str) -> str:
        # Between and after calls, only the newlines that separate blocks: not content.
        return "" if self.calls and not text.strip() else text
