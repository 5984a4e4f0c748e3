"""``Speculator``: the one owner of speculative decoding in the engine step. It joins the step at
two named places: ``propose`` drafts tokens for the running sequences before the step is scheduled
(the scheduler gives a speculating sequence ``1 + k`` query tokens in the ragged batch, and cuts
drafts first when the budget or the KV blocks run short), and ``verify``, handed to the model
runner at construction, turns a speculating sequence's ``1 + k`` logits rows into the tokens it
emits (``verifier``: greedy acceptance, or rejection sampling for sampled requests) and counts
them. The step's size and time (``observe_step``) feed the adaptive policy.

Which sequences speculate: those past ``min_tokens`` that have caught up (one token to compute) and
have no logits processor (``SamplingParams.has_logits_processors``: the verifier does not run them); a
sequence with a grammar keeps the drafts its grammar admits (``draft_filter``, the structured
outputs manager's ``valid_drafts``), and each of its ``1 + k`` positions is verified under the
grammar's mask there. ``k`` is capped so a step never emits more than ``max_tokens`` allows and
never places a draft at ``max_model_len`` or beyond; with ``adaptive`` (the default) the policy of
``spec_decode.policy`` keeps only the drafts that raise the step's expected tokens per second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cb_serve.config.speculative import SpeculativeConfig
from cb_serve.sequence import Sequence
from cb_serve.spec_decode.policy import (
    ENGINE_DECAY,
    PRIOR,
    PRIOR_WEIGHT,
    PROBE_FIRST,
    PROBE_MAX,
    SEQ_DECAY,
    AcceptanceEstimate,
    StepCostCurve,
    choose_num_drafts,
    draft_gains,
)
from cb_serve.spec_decode.proposer import DraftProposer, NgramProposer
from cb_serve.spec_decode.verifier import verify_drafts
from cb_serve.stats import SpecDecodingStats

DraftFilter = Callable[[Sequence, list[int]], list[int]]


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
    idle_steps: int = 0  # steps with proposals since it last kept a draft (``policy``: probes)
    probe_every: int = PROBE_FIRST


class NoSpeculation:
    """Speculative decoding off: the ``Speculator``'s interface, with nothing proposed."""

    def propose(self, running: list[Sequence]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def verify(self, seq: Sequence, logits: torch.Tensor, grammar: torch.Tensor | None) -> tuple[list, list]:
        raise AssertionError("a sequence carries drafts while speculative decoding is off")

    def observe_step(self, num_scheduled_tokens: int, seconds: float) -> None:
        pass

    hidden_sink = None

    def take_stats(self) -> SpecDecodingStats:
        return SpecDecodingStats()


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        proposer: DraftProposer | None = None,
        draft_filter: DraftFilter | None = None,
    ) -> None:
        """``proposer``: the draft model's or the MTP layers' (the engine builds it); None for n-gram drafts.
        ``draft_filter(seq, drafts)``: the drafts ``seq`` may keep (its grammar's)."""
        assert (proposer is None) == (config.method == "ngram"), config.method
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_filter = draft_filter or (lambda seq, drafts: drafts)
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)  # cumulative
        self._step = self._new_step_stats()
        self.cost = StepCostCurve()
        self.first_draft = AcceptanceEstimate()  # engine-wide
        self.later_drafts = [AcceptanceEstimate() for _ in range(config.num_speculative_tokens - 1)]  # given the last

    def num_drafts_for(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may draft this step (0: it decodes one token)."""
        params = seq.params
        if seq.num_output_tokens < params.min_tokens or params.has_logits_processors:
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
        self.proposer.prepare(running)
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
        drafts = [self.draft_filter(s, d) for s, d in zip(seqs, self.proposer.propose(seqs, counts))]
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
            kept[i] = n  # none where none was proposed (no gains to rank)
            state = seqs[i].spec_state
            if kept[i] or not counts[i]:
                state.idle_steps = 0
                continue
            state.idle_steps += 1
            if state.idle_steps >= state.probe_every:  # unmeasured for a while: one draft, to measure
                kept[i], state.idle_steps = 1, 0
                state.probe_every = min(2 * state.probe_every, PROBE_MAX)
        return kept

    @property
    def hidden_sink(self) -> Callable | None:
        """The proposer's reader of the target's hidden states (MTP), handed to the model runner; else None."""
        return self.proposer.hidden_sink

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted (the scheduler's ``on_release``)."""
        self.proposer.release(seq)

    def verify(
        self, seq: Sequence, logits: torch.Tensor, grammar: torch.Tensor | None
    ) -> tuple[list[int], list[dict | None]]:
        """The tokens ``seq`` emits from its ``1 + k`` logits rows (its accepted drafts, then the
        target's token) and their logprobs; counted in the stats and the policy's estimates."""
        emitted, logprobs = verify_drafts(seq, logits, grammar)
        self.record(seq, len(seq.spec_token_ids), len(emitted))
        return emitted, logprobs

    def record(self, seq: Sequence, num_drafts: int, num_emitted: int) -> None:
        """One verified sequence-step: ``num_drafts`` drafted, ``num_emitted`` emitted (the accepted
        drafts and the target's own token)."""
        accepted = num_emitted - 1
        self._step.observe(num_drafts, accepted)
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_pos[i] += 1
        seq.spec_state.first_draft.record(accepted > 0, SEQ_DECAY)
        if accepted:
            seq.spec_state.probe_every = PROBE_FIRST
        self.first_draft.record(accepted > 0, ENGINE_DECAY)
        for j in range(1, min(accepted + 1, num_drafts)):  # the drafts whose predecessor was accepted
            self.later_drafts[j - 1].record(j < accepted, ENGINE_DECAY)

    def observe_step(self, num_scheduled_tokens: int, seconds: float) -> None:
        """A step of decodes only (drafts included) took ``seconds``: the policy's cost curve."""
        self.cost.observe(num_scheduled_tokens, seconds)

    def take_stats(self) -> SpecDecodingStats:
        """The verifications since the previous call."""
        stats, self._step = self._step, self._new_step_stats()
        return stats

    def _new_step_stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(num_accepted_tokens_per_pos=(0,) * self.config.num_speculative_tokens)
