"""Speculation joins the engine step at two places: ``propose`` drafts tokens for the running
sequences before the step is scheduled (the scheduler gives a speculating sequence ``1 + k``
query tokens in the ragged batch), and ``record`` counts what the verification accepted.

Which sequences speculate: those without a grammar, past ``min_tokens``, that have caught up (one
token to compute). ``k`` is capped so a step never emits more than ``max_tokens`` allows and never
places a draft at ``max_model_len`` or beyond. The model runner verifies the drafts
(``model_executor.draft_verifier``: greedy acceptance, or rejection sampling for sampled requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cb_serve.sequence import Sequence
from cb_serve.spec_decode.config import SpeculativeConfig
from cb_serve.spec_decode.ngram import NgramIndex


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
        if seq.matcher is not None or seq.num_output_tokens < params.min_tokens:
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

    def record(self, num_drafts: int, num_emitted: int) -> None:
        """One verified sequence-step: ``num_drafts`` drafted, ``num_emitted`` tokens emitted (the
        accepted drafts and the target's own token)."""
        if num_drafts:
            c = self.counters
            c.num_drafts += 1
            c.num_draft_tokens += num_drafts
            c.num_accepted_tokens += num_emitted - 1
            for i in range(num_emitted - 1):
                c.accepted_per_pos[i] += 1
