"""Reasoning output (vLLM's reasoning parsers): ``reasoning_parser(name, tokenizer)``."""

from __future__ import annotations

from typing import Any

from cb_serve.reasoning.base import ReasoningParser
from cb_serve.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from cb_serve.reasoning.granite import GraniteReasoningParser, GraniteSplitter
from cb_serve.reasoning.harmony import HarmonyReasoningEnd, HarmonySplitter
from cb_serve.reasoning.qwen3 import Qwen3ReasoningParser
from cb_serve.reasoning.splitter import ReasoningSplitter

PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GraniteReasoningParser)
}


def reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser vLLM calls ``name`` for this tokenizer (``ValueError``: unknown name, or the
    tokenizer has no think tokens)."""
    if name not in PARSERS:
        raise ValueError(f"Unknown reasoning_parser {name!r} (one of {sorted(PARSERS)}).")
    return PARSERS[name](tokenizer)


__all__ = [
    "PARSERS",
    "DeepSeekR1ReasoningParser",
    "GraniteReasoningParser",
    "GraniteSplitter",
    "HarmonyReasoningEnd",
    "HarmonySplitter",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningSplitter",
    "reasoning_parser",
]
