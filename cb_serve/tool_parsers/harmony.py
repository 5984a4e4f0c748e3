"""``openai``: gpt-oss's tool calls (Harmony), as ``reasoning.HarmonySplitter`` passes them on from the
``commentary`` channel: ``<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>``, the arguments
a JSON object. Hermes blocks are read too (what a forced call's grammar writes)."""

from __future__ import annotations

import json

from cb_serve.harmony_format import CALL, HARMONY_CALL_OPEN, MESSAGE
from cb_serve.tool_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from cb_serve.tool_parsers.base import ParsedToolCall, ToolCallParser, parse_calls


class HarmonyToolParser(ToolCallParser):
    name = "openai"
    keeps_special_tokens = True
    blocks = ((HARMONY_CALL_OPEN, CALL), (TOOL_CALL_OPEN, TOOL_CALL_CLOSE))

    def parse_block(self, body: str, opened: str = TOOL_CALL_OPEN) -> list[ParsedToolCall] | None:
        if opened != HARMONY_CALL_OPEN:
            return parse_calls(body)
        name, sep, arguments = body.partition(MESSAGE)
        try:
            value = json.loads(arguments) if sep else None
        except ValueError:
            return None
        if not isinstance(value, dict) or not name or any(c.isspace() for c in name):
            return None
        return [ParsedToolCall(name, json.dumps(value, ensure_ascii=False))]
