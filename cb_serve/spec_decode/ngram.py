"""Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's longest matching suffix, in its own prompt and output.

``NgramIndex`` keeps, for every n in ``[min_n, max_n]``, the last position each n-gram ended at
among those whose next token is known. Appending a token records one n-gram per n (the ones it
completes as a successor), so the index costs O(max_n - min_n + 1) per token, never a rescan;
a proposal is at most that many dictionary lookups plus the draft's slice.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]

    def extend(self, token_ids: list[int]) -> None:
        for token in token_ids:
            end = len(self.tokens) - 1  # the n-grams ending here now have a successor: ``token``
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_end[n - self.min_n][tuple(self.tokens[end - n + 1 : end + 1])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix n-gram seen before (none: no match)."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self.last_end[n - self.min_n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []
