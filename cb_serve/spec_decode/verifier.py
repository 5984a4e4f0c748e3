"""Verifying one sequence's drafts against the target's logits at its ``1 + k`` positions, with the
sampler's own filters: greedy picks for a greedy request, rejection sampling (with the request's
seeded generator) for a sampled one, and the logprobs of every emitted token."""

from __future__ import annotations

import torch

from cb_serve.model_executor.sampler import Sampler, SamplingBatch, greedy_tokens
from cb_serve.sequence import Sequence
from cb_serve.spec_decode.verify import accept_greedy, rejection_sample
from cb_serve.structured_outputs.base import apply_bitmask


def verify_drafts(
    seq: Sequence, logits: torch.Tensor, grammar: torch.Tensor | None = None
) -> tuple[list[int], list[dict | None]]:
    """The tokens ``seq`` emits (its accepted drafts, then the target's token) and their logprobs.
    ``logits``: float32 ``[1 + k, vocab]``, unmodified (a speculating sequence is past its banned
    tokens). ``grammar``: the grammar's bitmask at each of the ``1 + k`` positions
    (``StructuredOutputManager.grammar_bitmask``), applied before any pick; logprobs are of the raw
    logits, as sampled."""
    drafts = seq.spec_token_ids
    assert logits.shape[0] == len(drafts) + 1
    raw_logits = logits
    if grammar is not None:
        logits = logits.clone()
        apply_bitmask(logits, grammar)
    if seq.params.greedy:
        emitted = accept_greedy(drafts, greedy_tokens(logits).tolist())  # the first maximum, as sampled
    else:
        probs = Sampler.probabilities(logits, SamplingBatch.from_seqs([seq] * logits.shape[0]))
        emitted = rejection_sample(drafts, probs.cpu(), None, seq.generator)  # CPU: seeded draws on any device
    if seq.params.logprobs is None:
        return emitted, [None] * len(emitted)
    raw = torch.log_softmax(raw_logits[: len(emitted)], dim=-1)
    return emitted, Sampler.token_logprobs(raw, SamplingBatch.from_seqs([seq] * len(emitted)), emitted)
