"""Draft proposers behind one interface: the speculator asks each step for up to ``k`` drafts of
every sequence that may speculate, in one batched call (a draft model runs them as one batch)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from cb_serve.sequence import Sequence
from cb_serve.spec_decode.ngram import NgramIndex


class DraftProposer(ABC):
    proposes_for_free = True  # drafting costs next to nothing: propose k, then let the policy trim

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        """Up to ``num_drafts[i]`` draft tokens to follow ``seqs[i]`` (fewer or none is fine)."""

    def release(self, seq: Sequence) -> None:  # noqa: B027 - a proposer without per-sequence state has nothing to free
        """``seq`` finished or was preempted: free what the proposer holds for it."""

    def prepare(self, running: list[Sequence]) -> None:  # noqa: B027 - most proposers need no look at every sequence
        """Before the step's proposals, with every running sequence (the MTP proposer catches up here)."""

    @property
    def hidden_sink(self) -> Callable | None:
        """Called by the target's runner after each forward pass with its rows' hidden states, for a proposer that
        drafts from them (MTP: ``observe_hidden``); None for the others."""
        return None


class NgramProposer(DraftProposer):
    """Prompt lookup: each sequence's own incremental ``NgramIndex`` over its prompt and output."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, num_drafts):
            index = seq.spec_state.ngram
            if index is None:
                index = seq.spec_state.ngram = NgramIndex(self.min_n, self.max_n)
            index.extend(seq.token_ids[len(index.tokens) :])  # only what is new since the last step
            drafts.append(index.propose(k))
        return drafts
