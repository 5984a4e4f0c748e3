"""Speculation joins the engine step at two places: ``propose`` drafts tokens for the running
sequences before the step is scheduled (the scheduler gives a speculating sequence ``1 + k``
query tokens in the ragged batch), and ``accept`` turns the target's picks at those ``1 + k``
positions into the tokens the sequence emits.

Which sequences speculate: greedy ones (temperature 0) without a grammar, past ``min_tokens``,
that have caught up (one token to compute). ``k`` is capped so a step never emits more than
``max_tokens`` allows and never places a draft at ``max_model_len`` or beyond. Sampled requests
decode one token a step as before (``verify.rejection_sample`` is their verifier, not yet wired).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cb_serve.sequence import Sequence
from cb_serve.spec_decode.config import SpeculativeConfig
from cb_serve.spec_decode.ngram import NgramIndex
from cb_serve.spec_decode.verify import accept_greedy


@dataclass
class SpecCounters:
    """Cumulative, as vLLM's ``spec_decode`` metrics count them."""

    num_drafts: int = 0  # sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        if config.method != "ngram":
            raise ValueError(f"speculative_config method {config.method!r} is not supported yet (use ngram).")
        self.config = config
        self.max_model_len = max_model_len
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)

    def num_drafts_for(self, seq: Sequence) -> int:
        """How many tokens ``seq`` may draft this step (0: it decodes one token)."""
        params = seq.params
        if not params.greedy or seq.matcher is not None or seq.num_output_tokens < params.min_tokens:
            return 0
        if seq.num_tokens - seq.num_computed_tokens != 1:
            return 0  # still prefilling, or a jump-forward chunk pending
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    def propose(self, running: list[Sequence]) -> None:
        """Sets each running sequence's ``spec_token_ids`` (n-gram drafts, possibly none)."""
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        for seq in running:
            k = self.num_drafts_for(seq)
            if k == 0:
                seq.spec_token_ids = []
                continue
            if seq.ngram is None:
                seq.ngram = NgramIndex(low, high)
            seq.ngram.extend(seq.token_ids[len(seq.ngram.tokens) :])  # only what is new since the last step
            seq.spec_token_ids = seq.ngram.propose(k)

    def accept(self, seq: Sequence, picks: list[int]) -> list[int]:
        """The tokens ``seq`` emits, given the target's greedy picks at its ``1 + k`` positions."""
        drafts = seq.spec_token_ids
        emitted = accept_greedy(drafts, picks)
        if drafts:
            c = self.counters
            c.num_drafts += 1
            c.num_draft_tokens += len(drafts)
            c.num_accepted_tokens += len(emitted) - 1
            for i in range(len(emitted) - 1):
                c.accepted_per_pos[i] += 1
        return emitted
