"""Tool calls out of generated text, as it streams, in each family's format (one module per format, each a
``ToolCallParser`` from ``base.py``); everything else stays content:

- ``hermes`` (Hermes, Qwen2.5, Qwen3, SmolLM3, and the built-in prompt): JSON,
  ``{"name": ..., "arguments": {...}}`` (or a list of calls, as SmolLM2 was trained to write);
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): XML, ``<function=NAME><parameter=KEY>value</parameter>...
  </function>``, each value typed by the tool's parameter schema (a string stays as written);
- ``llama3_json`` (Llama 3.1 to 3.3): the whole reply is ``{"name": ..., "parameters": {...}}``;
- ``mistral`` (Mistral, Magistral, Ministral, Devstral): ``[TOOL_CALLS]`` then a JSON list of calls, or
  ``NAME[ARGS]{...}`` per call. ``[TOOL_CALLS]`` is a special token: a request read by this parser keeps
  special tokens in its text (``keeps_special_tokens``, as vLLM's ``adjust_request`` does);
- ``granite`` (Granite 3.x): the reply is ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``;
- ``deepseek_v3`` (DeepSeek V3, R1, V3.1): ``<｜tool▁call▁begin｜>`` blocks between its section tokens;
- ``openai`` (gpt-oss, Harmony): ``commentary`` messages to ``functions.NAME``, as the Harmony splitter passes
  them on (``reasoning/harmony.py``).

The format is chosen from the model's chat template (``tool_call_parser_for_template``) unless the
``tool_call_parser`` engine argument names one (vLLM's flag). A block that does not parse stays
content, as vLLM's parsers leave it; a JSON block is read by every parser (what a forced call's
grammar writes)."""

from __future__ import annotations

from cb_serve.harmony_format import is_harmony_template
from cb_serve.tool_parsers.base import ParsedToolCall, ToolCallParser, calls_of, json_calls, parse_calls
from cb_serve.tool_parsers.deepseek_v3 import CALL_BEGIN, DeepSeekV3ToolParser
from cb_serve.tool_parsers.harmony import HarmonyToolParser
from cb_serve.tool_parsers.mistral import MISTRAL_CALLS, MistralToolParser
from cb_serve.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from cb_serve.tool_parsers.whole_reply import GRANITE_CALLS, GraniteToolParser, Llama3JsonToolParser

__all__ = [
    "DeepSeekV3ToolParser",
    "GraniteToolParser",
    "HarmonyToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedToolCall",
    "Qwen3CoderToolParser",
    "TOOL_CALL_PARSERS",
    "ToolCallParser",
    "calls_of",
    "json_calls",
    "parse_calls",
    "tool_call_parser_for_template",
]


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": ToolCallParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "granite": GraniteToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "openai": HarmonyToolParser,
}


def tool_call_parser_for_template(template: str | dict[str, str] | None) -> str:
    """The tool-call format a chat template writes calls in (its markers); ``hermes`` by default (the
    built-in tool prompt for a template without tools writes it too)."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    if any("<function=" in t and "<parameter=" in t for t in texts):
        return "qwen3_coder"
    if any("<|start_header_id|>" in t and '"parameters": ' in t for t in texts):  # Llama 3.1 / 3.2 / 3.3
        return "llama3_json"
    if any(is_harmony_template(t) for t in texts):  # gpt-oss
        return "openai"
    if any(CALL_BEGIN in t for t in texts):  # DeepSeek V3, R1, V3.1
        return "deepseek_v3"
    if any(MISTRAL_CALLS in t for t in texts):
        return "mistral"
    if any(GRANITE_CALLS in t and "<|start_of_role|>" in t for t in texts):  # Granite 3.x
        return "granite"
    return "hermes"
