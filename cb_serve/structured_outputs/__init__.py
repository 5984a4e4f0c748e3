"""Structured outputs: constraints (JSON schema, regex, choice, grammar) that mask each step's
logits of the sequences that carry them (``base.py`` is the backend interface)."""

from cb_serve.structured_outputs.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
)
from cb_serve.structured_outputs.compiler import GrammarCompiler
from cb_serve.structured_outputs_params import ConstraintLimits, StructuredOutputsParams

__all__ = [
    "CompiledGrammar",
    "ConstraintLimits",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarMatcher",
    "StructuredOutputsParams",
    "allocate_bitmask",
    "apply_bitmask",
]
