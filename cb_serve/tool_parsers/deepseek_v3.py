"""DeepSeek V3's calls, between its own delimiter tokens:
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``. Inside a call, V3 and R1
write ``function<｜tool▁sep｜>NAME`` then the arguments in a fenced JSON block; V3.1 and later write
``NAME<｜tool▁sep｜>ARGUMENTS``."""

from __future__ import annotations

import json
import re

from cb_serve.tool_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from cb_serve.tool_parsers.base import ParsedToolCall, ToolCallParser, parse_calls

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
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
        except ValueError:
            return None
        if not isinstance(value, dict) or not name.strip():
            return None
        return [ParsedToolCall(name.strip(), json.dumps(value, ensure_ascii=False))]
