"""The llguidance backend (PyPI ``llguidance``): JSON schemas, regexes, choices and Lark grammars
compiled lazily into an Earley parser over a token trie. API facts relied on (llguidance 1.x,
``llguidance/_lib.pyi``): ``LLMatcher(tokenizer, grammar, limits=...)`` never raises for a bad
grammar, it enters an error state (``is_error``/``get_error``); ``LLMatcher.validate_grammar``
returns "" or the error; ``grammar_from_json_schema``/``grammar_from_regex``/``grammar_from_lark``
build the grammar text; ``unsafe_compute_mask_ptr(ptr, nbytes)`` writes one bitmask row (what
``llguidance.torch.fill_next_token_bitmask`` wraps); ``compute_ff_tokens`` gives the forced tokens;
``consume_token``, ``rollback``, ``is_stopped``; ``llguidance.hf.from_tokenizer`` wraps a fast
HF tokenizer (expensive: done once per backend)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import llguidance
import llguidance.hf
import torch

from cb_serve.errors import InvalidRequestError
from cb_serve.structured_outputs.base import CompiledGrammar, GrammarBackend, GrammarMatcher, allocate_bitmask
from cb_serve.structured_outputs_params import PARAM, StructuredOutputsParams
from cb_serve.tool_format import SPECIAL_TOKEN, resolve_special_tokens

# Parser resource limits (llguidance's own fuel): a grammar that needs more fails, it never stalls.
LIMITS = dict(max_grammar_size=200_000, max_lexer_states=100_000, step_lexer_fuel=200_000, verbose_errors=False)
# JSON output in one line, as OpenAI's and vLLM's default: no free whitespace between tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        assert words.is_contiguous() and words.dtype == torch.int32 and words.device.type == "cpu"
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def valid_prefix(self, token_ids: list[int]) -> int:
        return self._m.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        assert self._m.rollback(num_tokens), self._m.get_error()

    @property
    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def forced_tokens(self) -> list[int]:
        return list(self._m.compute_ff_tokens())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceGrammar(CompiledGrammar):
    """Holds a matcher at the start of the grammar; each sequence gets a copy (``deep_copy``
    shares the compiled grammar: cheap, no compile work on the engine's thread)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        limits = llguidance.LLParserLimits(**LIMITS)
        self._start = LLGuidanceMatcher(llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits))

    @property
    def error(self) -> str | None:
        return self._start.error

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._start._m.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        """``vocab_size``: the model's (its logits' width, which may exceed the tokenizer's)."""
        self._vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self._added_tokens = {t: i for t, i in hf_tokenizer.get_added_vocab().items() if i < vocab_size}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        if params.grammar is not None and SPECIAL_TOKEN.search(params.grammar):  # a tool-call format's markers
            params = replace(params, grammar=resolve_special_tokens(params.grammar, self._added_tokens))
        grammar = self._grammar_text(params)
        limits = llguidance.LLParserLimits(**LIMITS)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=limits)
        if error:
            raise unusable(params.kind, error)
        compiled = LLGuidanceGrammar(self.tokenizer, grammar)  # builds the lexer: its errors are the request's too
        probe = compiled.matcher()  # the first mask, here rather than in a step: a grammar that fails it is a 400
        probe.fill_bitmask(allocate_bitmask(1, self._vocab_size), 0)
        error = compiled.error or probe.error
        if error:
            raise unusable(params.kind, error)
        return compiled

    @staticmethod
    def _grammar_text(params: StructuredOutputsParams) -> str:
        kind = params.kind
        try:
            if kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(params.schema(), defaults=JSON_OPTIONS)
            if kind == "json_object":
                schema = {"type": "object"}
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(params.regex)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in params.choice or ())
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            return llguidance.LLMatcher.grammar_from_lark(params.grammar)
        except (ValueError, RuntimeError, TypeError) as e:
            raise unusable(kind, str(e)) from None


def unusable(kind: str, error: str, limit: int = 300) -> InvalidRequestError:
    """A 400 naming the problem: the first line of the backend's error, cut."""
    first = error.strip().splitlines()[0] if error.strip() else "invalid"
    detail = re.sub(r"\s+", " ", first)[:limit]
    return InvalidRequestError(f"structured_outputs: the {kind} cannot be used: {detail}", PARAM)
