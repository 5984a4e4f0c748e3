"""How tool calls look in the model's text: Hermes-style ``<tool_call>`` blocks holding
``{"name": ..., "arguments": {...}}``, the format most open chat templates use (Qwen2.5, Hermes,
SmolLM3). For a chat template without tools (SmolLM2's) the conversation is rendered with the
built-in prompt below; ``required`` and named tool choices become a grammar over the same format
(``tool_call_constraint``; other formats write their own, ``ToolCallParser.constraint``, with the helpers at
the end), so the arguments always fit the tool's ``parameters`` schema."""

from __future__ import annotations

import json
import re
from typing import Any

from cb_serve.structured_outputs_params import StructuredOutputsParams

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# The separators json.dumps writes by default, so constrained calls look like the rendered history.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

BUILTIN_TOOL_PROMPT = """# Tools

You may call one or more functions to answer the user. The functions are listed as JSON inside \
<tools></tools>:
<tools>
{tools}
</tools>

To call a function, reply with a JSON object holding the function's name and arguments inside \
<tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def format_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    """One call as the model writes it."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{TOOL_CALL_CLOSE}"


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself (it mentions them)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in t for t in texts)


def render_builtin(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template without tools: the tool list joins the system message,
    an assistant's calls become ``<tool_call>`` blocks in its content, and consecutive tool
    results become one user turn of ``<tool_response>`` blocks (as Qwen2.5's template does)."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        prompt = BUILTIN_TOOL_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
        else:
            out.append({"role": "system", "content": prompt})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_responses": True})
        elif m.get("tool_calls"):
            calls = [format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *calls]))})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def tool_call_schema(tools: list[dict[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call of any of ``tools`` (OpenAI tool objects), ``{"name", arguments_key}``.
    Each tool's ``parameters`` move under the root's ``$defs`` (its own ``$defs`` beside them, renamed), so
    its ``$ref``s, which name its own root, still resolve."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        prefix = f"tool{i}"
        params = _relocate(closed(tool["function"].get("parameters") or NO_PARAMETERS), prefix)
        for key in ("$defs", "definitions"):
            own = params.pop(key, None)
            defs.update({f"{prefix}.{k}": v for k, v in own.items()} if isinstance(own, dict) else {})
        defs[prefix] = params
        calls.append({
            "type": "object",
            "properties": {"name": {"const": tool["function"]["name"]}, arguments_key: {"$ref": f"#/$defs/{prefix}"}},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })  # fmt: skip
    return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "$defs": defs}


def closed(params: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` without arguments it does not name: a plain object schema that says
    nothing of ``additionalProperties`` gets ``false``, as OpenAI's strict mode requires (every
    call still fits the schema as given; a small model no longer pads calls with invented keys)."""
    plain = params.get("type") == "object" and "properties" in params
    plain = plain and not any(k in params for k in ("allOf", "anyOf", "oneOf", "$ref"))
    if plain and "additionalProperties" not in params and "patternProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def _relocate(node: Any, prefix: str) -> Any:
    """A copy of a schema whose ``$ref``s to its root (``#``, ``#/$defs/X``, ``#/definitions/X``)
    name the same places once it sits at ``#/$defs/<prefix>`` (recursive: called only on schemas
    within the depth cap)."""
    if isinstance(node, list):
        return [_relocate(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _relocate(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        parts = ref[2:].split("/") if ref != "#" else []
        if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
            out["$ref"] = "/".join(["#", "$defs", f"{prefix}.{parts[1]}", *parts[2:]])
        else:
            out["$ref"] = "/".join(["#", "$defs", prefix, *parts])
    return out


def tool_call_constraint(tools: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
    """A Lark grammar (llguidance's dialect): one or more ``<tool_call>`` blocks (one when not
    ``parallel``), each a call of one of ``tools``, and nothing else."""
    schema = {**tool_call_schema(tools), "x-guidance": JSON_STYLE}
    repeat = ' ("\\n" call)*' if parallel else ""
    grammar = (
        f"start: call{repeat}\n"
        f'call: "{TOOL_CALL_OPEN}\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
        f"body: %json {json.dumps(schema)}\n"
    )
    return StructuredOutputsParams(grammar=grammar)


def arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters`` as the schema its arguments are written to (closed: ``closed``)."""
    return closed(tool["function"].get("parameters") or NO_PARAMETERS)


def json_rule(schema: dict[str, Any]) -> str:
    """A grammar's ``%json`` for ``schema``, written with the separators of ``json.dumps`` (as histories are)."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def special_token(text: str) -> str:
    """A marker in a tool-call grammar that may be one special token (``[TOOL_CALLS]``, ``<|channel|>``): the
    structured-outputs backend makes it that token where the tokenizer has it, else the text
    (``resolve_special_tokens``)."""
    return f"<special:{json.dumps(text)}>"


SPECIAL_TOKEN = re.compile(r'<special:("(?:[^"\\]|\\.)*")>')


def resolve_special_tokens(grammar: str, vocab: dict[str, int]) -> str:
    """``grammar`` with each ``special_token`` marker made the token ``<[id]>`` of that text (llguidance's
    syntax), or the text's literal where the vocabulary has no such token."""

    def one(match: re.Match[str]) -> str:
        text = json.loads(match.group(1))
        return f"<[{vocab[text]}]>" if text in vocab else lark_string(text)

    return SPECIAL_TOKEN.sub(one, grammar)
