"""Incremental detokenization that waits out split multi-byte characters. Whether the text
holds a stop string is the ``StopChecker``'s call, not this class's.

One algorithm, two implementations of its step. The state is the token ids and two offsets
(vLLM's ``prefix_offset`` / ``read_offset``): a new token's text is what decoding
``ids[prefix_offset:]`` adds to decoding ``ids[prefix_offset:read_offset]``, once it does not
end in U+FFFD. ``tokenizers``' ``DecodeStream`` runs that step in Rust (one call per token);
the Python step (two ``tokenizer.decode`` calls) serves slow tokenizers, tokenizers whose
``decode`` post-processes the text (``clean_up_tokenization_spaces``), and any token the Rust
step refuses (its prefix check), from which the sequence stays on the Python step. Both give
the same text: ``tests/engine/test_detokenizer.py`` holds them equal. (One corner stays: a decoder
that rewrites earlier text so that the window's decoding no longer starts with the previous prefix yet
has no more bytes than it; the Rust step then waits for the next token where the Python step would
emit. No decoder of the families served does that.)
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the Python step only
    DecodeStream = None

# Prompt tokens decoded as context for the first output token (spacing of word-piece
# tokenizers depends on the token before).
CONTEXT_TOKENS = 5


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` whose ``decode`` is exactly ``tokenizer.decode`` (a fast
    tokenizer that cleans up no spaces), or None."""
    if DecodeStream is None or not getattr(tokenizer, "is_fast", False):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return getattr(tokenizer, "backend_tokenizer", None)


class IncrementalDetokenizer:
    """Keeps the output text of one sequence. ``append`` decodes a new token against a short
    window of earlier ones and adds text only once it is whole (no U+FFFD at the end), so each
    call costs the same whatever the output length."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        rust: Any | None = None,
    ) -> None:
        """``rust``: ``rust_tokenizer(tokenizer)``, looked up once per tokenizer by the caller (None:
        the Python step)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._rust = rust
        self._stream = None
        if rust is not None:  # primed with the context: its text is the first prefix, as the Python step's
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            try:  # a list of ids: tokenizers >= 0.22 (before it, and on any error: the Python step)
                primed = not self.ids or stream.step(rust, self.ids) is not None
            except Exception:  # noqa: BLE001
                primed = False
            if primed:
                self._stream = stream  # (a context ending inside a character: the Python step)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> int:
        """Adds a token; returns how many characters of text it completed (0 while a character
        is still split across tokens)."""
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._rust, token_id)
            except Exception:  # noqa: BLE001 - the Rust step's prefix check: this sequence goes on in Python
                self._stream = None
            else:
                if delta is None:
                    return 0
                return self._advance(delta)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return 0
        return self._advance(full[len(prefix) :])

    def _advance(self, delta: str) -> int:
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return len(delta)

    def truncate(self, length: int) -> None:
        """Cuts the text at ``length`` characters (where a stop string begins or ends)."""
        self.text = self.text[:length]
