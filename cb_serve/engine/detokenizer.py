"""Incremental detokenization that waits out split multi-byte characters and finds stop
strings that span tokens."""

from __future__ import annotations

# Prompt tokens decoded as context for the first output token (spacing of word-piece
# tokenizers depends on the token before).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Keeps the output text of one sequence. ``append`` decodes a new token against a short
    window of earlier ones and emits text only once it is whole (no U+FFFD at the end)."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        # Streamed text holds back a possible start of a stop string until it is decided.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str | None:
        """Adds a token; returns the stop string it completed, if any (text is cut there)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return self._check_stop(len(delta))

    def _check_stop(self, delta_len: int) -> str | None:
        for stop in self.stop:
            start = max(0, len(self.text) - delta_len - len(stop) + 1)
            idx = self.text.find(stop, start)
            if idx != -1:
                self.text = self.text[: idx + (len(stop) if self.include_stop_str_in_output else 0)]
                return stop
        return None

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, minus what may still turn into a stop string."""
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
