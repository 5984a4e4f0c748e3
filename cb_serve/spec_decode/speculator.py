"""Speculation joins the engine step at two places: ``propose`` drafts tokens for the running
sequences before the step is scheduled (the scheduler gives a speculating sequence ``1 + k``
query tokens in the ragged batch), and ``record`` counts what the verification accepted; the
engine reports every step's size and time (``observe_step``) to the adaptive policy.

Which sequences speculate: those past ``min_tokens`` that have caught up (one token to compute);
a sequence with a grammar keeps the drafts its grammar admits (``grammar_prefix``), and each of its
``1 + k`` positions is verified under the grammar's mask there. ``k`` is capped so a step never
emits more than ``max_tokens`` allows and never places a draft at ``max_model_len`` or beyond; with
``adaptive`` (the default) the policy of ``spec_decode.policy`` keeps only the drafts that raise
the step's expected tokens per second. The model runner verifies the drafts
(``model_executor.draft_verifier``: greedy acceptance, or rejection sampling for sampled requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cb_serve.sequence import Sequence
from cb_serve.spec_decode.config import SpeculativeConfig
from cb_serve.spec_decode.policy import (
    ENGINE_DECAY,
    PRIOR,
    PRIOR_WEIGHT,
    SEQ_DECAY,
    AcceptanceEstimate,
    StepCostCurve,
    choose_num_drafts,
    draft_gains,
)
from cb_serve.spec_decode.proposer import DraftProposer, NgramProposer


@dataclass
class SpecCounters:
    """Cumulative, as vLLM's ``spec_decode`` metrics count them."""

    num_drafts: int = 0  # sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i


@dataclass
class SeqSpecState:
    """A sequence's own: its drafts' acceptance, and its proposer's state (an n-gram index)."""

    first_draft: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    ngram: Any = None


def grammar_prefix(seq: Sequence, drafts: list[int]) -> list[int]:
    """The drafts ``seq``'s grammar admits, up to the first it refuses or the one that would end it
    (the grammar's end is the target's to emit); the matcher is rolled back to where it was."""
    matcher = seq.matcher
    if matcher is None or not drafts:
        return drafts
    consumed = 0
    for token in drafts[: matcher.valid_prefix(drafts)]:  # each admitted, so accepting it is safe
        assert matcher.accept_token(token)
        consumed += 1
        if matcher.is_terminated:
            break
    keep = consumed - matcher.is_terminated
    if consumed:
        matcher.rollback(consumed)
    return drafts[:keep]


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        proposer: DraftProposer | None = None,
    ) -> None:
        """``proposer``: the draft model's (the engine builds it); None for n-gram drafts."""
        assert (proposer is None) == (config.method == "ngram"), config.method
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.cost = StepCostCurve()
        self.first_draft = AcceptanceEstimate()  # engine-wide
        self.later_drafts = [AcceptanceEstimate() for _ in range(config.num_speculative_tokens - 1)]  # given the last

    def num_drafts_for(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may draft this step (0: it decodes one token)."""
        params = seq.params
        if seq.num_output_tokens < params.min_tokens:
            return 0
        if seq.num_tokens - seq.num_computed_tokens != 1:
            return 0  # still prefilling, or a jump-forward chunk pending
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    def propose(self, running: list[Sequence]) -> None:
        """Sets each running sequence's ``spec_token_ids`` (drafts, possibly none). The policy
        trims free drafts (n-gram) after they are proposed, and tells a costly proposer (a draft
        model) how many to make before."""
        for seq in running:
            seq.spec_token_ids = []
        allowed = [(seq, k) for seq in running if (k := self.num_drafts_for(seq))]
        if not allowed:
            return
        seqs, counts = [s for s, _ in allowed], [k for _, k in allowed]
        for seq in seqs:
            if seq.spec_state is None:
                seq.spec_state = SeqSpecState()
        adaptive, free = self.config.adaptive, self.proposer.proposes_for_free
        if adaptive and not free:
            counts = self._choose(running, seqs, counts)
            seqs, counts = [s for s, n in zip(seqs, counts) if n], [n for n in counts if n]
        drafts = [grammar_prefix(s, d) for s, d in zip(seqs, self.proposer.propose(seqs, counts))]
        if adaptive and free:
            drafts = [d[:n] for d, n in zip(drafts, self._choose(running, seqs, [len(d) for d in drafts]))]
        for seq, d in zip(seqs, drafts):
            seq.spec_token_ids = list(d)

    def _choose(self, running: list[Sequence], seqs: list[Sequence], counts: list[int]) -> list[int]:
        """How many of its ``counts`` drafts each of ``seqs`` keeps (``policy.choose_num_drafts``). A
        seeded sampled request keeps all of its own: its draws depend on its drafts, and a choice
        made from measured times would make two identical runs differ."""
        free = [i for i, seq in enumerate(seqs) if seq.params.greedy or seq.params.seed is None]
        prior = self.first_draft.rate(PRIOR, PRIOR_WEIGHT)
        later = [e.rate(PRIOR, PRIOR_WEIGHT) for e in self.later_drafts]
        gains = [draft_gains(seqs[i].spec_state.first_draft.rate(prior, PRIOR_WEIGHT), later, counts[i]) for i in free]
        pinned = sum(counts) - sum(counts[i] for i in free)
        decodes = sum(seq.num_uncomputed_tokens == 1 for seq in running)  # the curve is of decode steps
        base_tokens = min(decodes + pinned, self.max_num_batched_tokens)
        kept = list(counts)
        for i, n in zip(free, choose_num_drafts(gains, base_tokens, decodes, self.cost)):
            kept[i] = n
        return kept

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted (the scheduler's ``on_release``)."""
        self.proposer.release(seq)

    def record(self, seq: Sequence, num_drafts: int, num_emitted: int) -> None:
        """One verified sequence-step: ``num_drafts`` drafted, ``num_emitted`` tokens emitted (the
        accepted drafts and the target's own token)."""
        if not num_drafts:
            return
        accepted = num_emitted - 1
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_pos[i] += 1
        seq.spec_state.first_draft.record(accepted > 0, SEQ_DECAY)
        self.first_draft.record(accepted > 0, ENGINE_DECAY)
        for j in range(1, min(accepted + 1, num_drafts)):  # the drafts whose predecessor was accepted
            self.later_drafts[j - 1].record(j < accepted, ENGINE_DECAY)

    def observe_step(self, num_scheduled_tokens: int, seconds: float) -> None:
        self.cost.observe(num_scheduled_tokens, seconds)
