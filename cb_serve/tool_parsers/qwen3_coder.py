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
    if schema is not None and is_text(schema):
        return text
    try:
        return json.loads({"True": "true", "False": "false", "None": "null"}.get(text, text))
    except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's depth
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


def is_text(schema: dict[str, Any]) -> bool:
    """A parameter whose value is written as text: a string, or an enum of strings only."""
    enum = schema.get("enum")
    strings = bool(enum) and all(isinstance(v, str) for v in enum)
    return schema.get("type") == "string" or (strings and "type" not in schema)


KEY = re.compile(r"[^\s<>=]([^<>\n]*[^\s<>])?")  # a key the <parameter=KEY> tag reads back as it is


def xml_spellable(schema: dict[str, Any]) -> bool:
    """Arguments XML parameters can spell: a closed object with ``properties`` whose keys the tag reads back,
    no ``$ref``, and no string with a constraint the text rule cannot check (pattern, format, length)."""
    closed_object = schema.get("type") == "object" and schema.get("additionalProperties") is False
    properties = schema.get("properties")
    if not closed_object or not isinstance(properties, dict) or '"$ref"' in json.dumps(schema):
        return False
    constrained = ("pattern", "format", "minLength", "maxLength")
    return all(
        isinstance(p, dict) and KEY.fullmatch(k) and not (is_text(p) and any(c in p for c in constrained))
        for k, p in properties.items()
    )


def xml_value(prop: dict[str, Any]) -> str:
    """A parameter's value rule: text (one of its enum, or text without ``<``), else JSON."""
    if is_text(prop) and prop.get("enum"):
        return "(" + " | ".join(lark_string(v) for v in prop["enum"]) + ")"
    if is_text(prop):
        return "/[^<]*/"
    return json_rule(prop)
