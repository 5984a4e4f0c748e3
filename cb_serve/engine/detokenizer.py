"""Incremental detokenization that waits out split multi-byte characters. Whether the text
holds a stop string is the ``StopChecker``'s call, not this class's."""

from __future__ import annotations

# Prompt tokens decoded as context for the first output token (spacing of word-piece
# tokenizers depends on the token before).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Keeps the output text of one sequence. ``append`` decodes a new token against a short
    window of earlier ones and adds text only once it is whole (no U+FFFD at the end), so each
    call costs the same whatever the output length."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> int:
        """Adds a token; returns how many characters of text it completed (0 while a character
        is still split across tokens)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return 0
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return len(delta)

    def truncate(self, length: int) -> None:
        """Cuts the text at ``length`` characters (where a stop string begins or ends)."""
        self.text = self.text[:length]
