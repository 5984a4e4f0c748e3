"""Qwen3-Coder's and Qwen3.5's XML calls inside ``<tool_call>`` blocks, each value typed by the tool's schema."""

from __future__ import annotations

import json
import re
from typing import Any

from cb_serve.structured_outputs_params import StructuredOutputsParams
from cb_serve.tool_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, arguments_schema, json_rule, lark_string
from cb_serve.tool_parsers.base import ParsedToolCall, ToolCallParser, parse_calls, per_tool_rules

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

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], parallel: bool, template: str = "") -> StructuredOutputsParams:
        """XML blocks as the template writes them: each parameter the schema names, in its order (the required
        ones always), a string as its text (no ``<`` in it) and any other value as JSON. Tools whose arguments
        XML cannot spell (no ``properties``, ``$ref``s, open objects) are written as JSON blocks, which this
        parser reads too."""
        if not all(xml_spellable(arguments_schema(t)) for t in tools):
            return super().constraint(tools, parallel, template)

        def call(name: str, schema: dict[str, Any]) -> str:
            required = set(schema.get("required") or ())
            parts = [lark_string(f"{TOOL_CALL_OPEN}\n<function={name}>\n")]
            for key, prop in schema["properties"].items():
                opened = lark_string(PARAMETER_OPEN.format(key=key))
                value = f"{opened} {xml_value(prop)} {lark_string(PARAMETER_END)}"
                parts.append(f"({value})" + ("" if key in required else "?"))
            return " ".join([*parts, lark_string(f"</function>\n{TOOL_CALL_CLOSE}")])

        return StructuredOutputsParams(grammar=per_tool_rules(tools, parallel, call, separator="\n"))


PARAMETER_OPEN, PARAMETER_END = "<parameter={key}>\n", "\n</parameter>\n"


def xml_spellable(schema: dict[str, Any]) -> bool:
    """Arguments XML parameters can spell: a closed object with ``properties`` and no ``$ref``."""
    closed_object = schema.get("type") == "object" and schema.get("additionalProperties") is False
    return closed_object and isinstance(schema.get("properties"), dict) and '"$ref"' not in json.dumps(schema)


def xml_value(prop: dict[str, Any]) -> str:
    """A parameter's value rule: a string as written (one of its enum, or text without ``<``), else JSON."""
    enum = prop.get("enum")
    if enum and all(isinstance(v, str) for v in enum) and prop.get("type") in (None, "string"):
        return "(" + " | ".join(lark_string(v) for v in enum) + ")"
    if prop.get("type") == "string" and not any(k in prop for k in ("pattern", "format", "minLength", "maxLength")):
        return "/[^<]*/"
    return json_rule(prop)
