"""``openai``: gpt-oss's tool calls (Harmony), as ``reasoning.HarmonySplitter`` passes them on from the
``commentary`` channel: ``<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>``, the arguments
a JSON object. Hermes blocks are read too (what a forced call's grammar writes)."""

from __future__ import annotations

import json
from typing import Any

from cb_serve.harmony_format import CALL, CHANNEL, CONSTRAIN, HARMONY_CALL_OPEN, MESSAGE
from cb_serve.structured_outputs_params import StructuredOutputsParams
from cb_serve.tool_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, json_rule, lark_string, special_token
from cb_serve.tool_parsers.base import ParsedToolCall, ToolCallParser, parse_calls, per_tool_rules


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
        except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's depth
            return None
        if not isinstance(value, dict) or not name or any(c.isspace() for c in name):
            return None
        return [ParsedToolCall(name, json.dumps(value, ensure_ascii=False))]

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool, template: str = "") -> StructuredOutputsParams:
        """One ``commentary`` message to ``functions.NAME`` with JSON arguments (a Harmony turn calls one tool;
        the stop token ``<|call|>`` follows), its markers as their special tokens."""

        def call(name: str, schema: dict[str, Any]) -> str:
            header = lark_string(f"commentary to=functions.{name} ")
            typed = f'{special_token(CONSTRAIN)} "json" {special_token(MESSAGE)}'
            return f"{special_token(CHANNEL)} {header} {typed} {json_rule(schema)}"

        # the grammar writes the whole turn: it applies from the first token, not after the reasoning
        return StructuredOutputsParams(grammar=per_tool_rules(tools, False, call), enable_in_reasoning=True)
