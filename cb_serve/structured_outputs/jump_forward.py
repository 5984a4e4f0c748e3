"""Jump-forward: where the grammar admits exactly one token, that token is appended without a
forward pass of its own (the tokens so appended join the sequence's next step as a prefill chunk).

Exactness: a token is appended only when the mask at its position admits it and nothing else,
checked here on the matcher's own mask, so decoding under the mask (greedy or sampled) could
have produced no other token there: the output is the token sequence the model would have
produced, and no retokenization is involved. (llguidance allows only the canonical tokenization
of forced text, so its forced tokens pass this check wherever it offers them.)"""

from __future__ import annotations

import torch

from cb_serve.structured_outputs.base import GrammarMatcher, allocate_bitmask


class JumpForward:
    """One scratch bitmask row; ``next_token`` is called on the engine's thread between steps."""

    def __init__(self, vocab_size: int) -> None:
        self._scratch = allocate_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def candidates(self, matcher: GrammarMatcher, limit: int) -> list[int]:
        """The grammar's forced tokens from here, at most ``limit`` (each still to be checked)."""
        return matcher.forced_tokens()[:limit] if limit > 0 else []

    def is_only_choice(self, matcher: GrammarMatcher, token_id: int) -> bool:
        """Whether the mask at the matcher's position admits ``token_id`` and no other token."""
        if not 0 <= token_id < self.vocab_size:
            return False
        matcher.fill_bitmask(self._scratch, 0)
        words = self._scratch[0]
        word, bit = divmod(token_id, 32)
        expected = torch.zeros_like(words)
        expected[word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)  # bit 31: a negative int32
        return bool(torch.equal(words, expected))
