"""Qwen3-Coder's and Qwen3.5's XML calls inside ``<tool_call>`` blocks, each value typed by the tool's schema."""

from __future__ import annotations

import json
import re
from typing import Any

from cb_serve.tool_format import TOOL_CALL_OPEN
from cb_serve.tool_parsers.base import ParsedToolCall, ToolCallParser, parse_calls

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

    def parse_block(self, body: str, opened: str = TOOL_CALL_OPEN) -> list[ParsedToolCall] | None:
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
