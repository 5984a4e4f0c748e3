"""DeepSeek V3's calls, between its own delimiter tokens:
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``. Inside a call, V3 and R1
write ``function<｜tool▁sep｜>NAME`` then the arguments in a fenced JSON block; V3.1 and later write
``NAME<｜tool▁sep｜>ARGUMENTS``."""

from __future__ import annotations

import json
import re
from typing import Any

from cb_serve.structured_outputs_params import StructuredOutputsParams
from cb_serve.tool_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, json_rule, lark_string, special_token
from cb_serve.tool_parsers.base import ParsedToolCall, ToolCallParser, parse_calls, per_tool_rules

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"
FENCED = re.compile(r"([^\n]+)\n```(?:json)?\n(.*)\n```", re.DOTALL)  # V3: NAME, then the fenced arguments


class DeepSeekV3ToolParser(ToolCallParser):
    """Each ``<｜tool▁call▁begin｜>`` block is a call, read when its end token arrives; the section tokens around
    them are dropped; a block that does not parse stays text. Hermes blocks are read too (what a forced
    call's grammar writes). The delimiters are kept in the text (``keeps_special_tokens``) in case a
    tokenizer marks them special."""

    name = "deepseek_v3"
    keeps_special_tokens = True
    blocks = ((CALL_BEGIN, CALL_END), (TOOL_CALL_OPEN, TOOL_CALL_CLOSE))
    dropped = (CALLS_BEGIN, CALLS_END)

    def parse_block(self, body: str, opened: str = TOOL_CALL_OPEN) -> list[ParsedToolCall] | None:
        if opened != CALL_BEGIN:
            return parse_calls(body)
        head, sep, rest = body.partition(SEP)
        if not sep:
            return None
        fenced = FENCED.fullmatch(rest.strip())
        name, arguments = (fenced.group(1), fenced.group(2)) if fenced and head == "function" else (head, rest)
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's depth
            return None
        if not isinstance(value, dict) or not name.strip():
            return None
        return [ParsedToolCall(name.strip(), json.dumps(value, ensure_ascii=False))]

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool, template: str = "") -> StructuredOutputsParams:
        """The calls between the section tokens, each in V3's form (a fenced JSON block) where the template
        writes it, else in V3.1's; every delimiter as its token."""
        fenced = "```json" in template

        def call(name: str, schema: dict[str, Any]) -> str:
            if fenced:  # function<｜tool▁sep｜>NAME, then the arguments fenced
                opened, closed = lark_string(name + FENCE_OPEN), lark_string(FENCE_CLOSE)
                body = f'"function" {special_token(SEP)} {opened} {json_rule(schema)} {closed}'
            else:
                body = f"{lark_string(name)} {special_token(SEP)} {json_rule(schema)}"
            return f"{special_token(CALL_BEGIN)} {body} {special_token(CALL_END)}"

        rules = per_tool_rules(tools, parallel, call, separator="\n" if fenced else "", start="calls")
        start = f"start: {special_token(CALLS_BEGIN)} calls {special_token(CALLS_END)}\n"
        return StructuredOutputsParams(grammar=start + rules)
