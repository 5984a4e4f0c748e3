"""Speculative decoding's parts (issue 25): configuration, the n-gram index, and verification of
drafts, greedy (exact) and by rejection sampling (distribution-exact, by a frequency test)."""

from __future__ import annotations

import math

import pytest
import torch

from cb_serve.spec_decode.config import SpeculativeConfig
from cb_serve.spec_decode.ngram import NgramIndex
from cb_serve.spec_decode.verify import accept_greedy, rejection_sample


def test_config_validates_like_vllm_names_it():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 3)
    SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2})
    for bad, match in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "lookup"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "Unknown"),
        ({"method": "ngram"}, "needs"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict(bad)


def naive_propose(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The definition: longest suffix n-gram (n in [low, high]) with an earlier occurrence that has a
    successor; the latest such occurrence; the up to k tokens after it."""
    for n in range(min(high, len(tokens)), low - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_ngram_index_equals_the_definition_token_by_token():
    rng = torch.Generator().manual_seed(0)
    for trial in range(40):
        vocab = 3 + trial % 5
        tokens = torch.randint(0, vocab, (120,), generator=rng).tolist()
        low, high = 1 + trial % 2, 2 + trial % 4
        index = NgramIndex(low, high)
        index.extend(tokens[:5])
        for i in range(5, len(tokens)):
            assert index.propose(4) == naive_propose(tokens[:i], 4, low, high), (trial, i)
            index.extend(tokens[i : i + 1])


def test_ngram_drafts_copy_a_repeated_passage():
    passage = [11, 12, 13, 14, 15, 16, 17]
    index = NgramIndex(1, 3)
    index.extend([1, 2, *passage, 3, 4, 11, 12])
    assert index.propose(3) == [13, 14, 15]
    assert index.propose(10) == [13, 14, 15, 16, 17, 3, 4, 11, 12]  # never past the known tokens
    index.extend([99])
    assert index.propose(3) == []  # 99 was never seen before


def test_greedy_acceptance_takes_the_agreeing_prefix_and_one_more():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the target's token at the first miss
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_greedy([], [4]) == [4]


def within(freq: float, p: float, n: int) -> bool:
    """|freq - p| within 5 standard deviations: a correct sampler fails with probability < 1e-6 per
    check (normal approximation)."""
    return abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one-hot drafts", "draft-model drafts"])
def test_rejection_sampling_emits_the_target_distribution(with_draft_probs):
    """First and second emitted tokens (a second token exists only when the first draft was kept)
    follow the target's distributions over 20,000 seeded draws: for fixed one-hot drafts, and for
    drafts drawn from the drafter's ``q`` (what the guarantee assumes)."""
    vocab, n = 5, 20_000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1], [0.2] * 5])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.1, 0.2, 0.2, 0.2]])
    drafts = [1, 2]  # the first draft is a token the target rarely picks
    gen = torch.Generator().manual_seed(1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(n):
        if with_draft_probs:
            drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = rejection_sample(drafts, p, q if with_draft_probs else None, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    for token in range(vocab):
        assert within(float(first[token]) / n, float(p[0, token]), n), (token, first / n)
        kept = int(second.sum())
        assert within(float(second[token]) / kept, float(p[1, token]), kept), (token, second / kept)


def test_rejection_sampling_is_reproducible_with_a_seed():
    p = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), dim=-1)
    runs = [rejection_sample([3, 7, 9], p, None, torch.Generator().manual_seed(42)) for _ in range(2)]
    assert runs[0] == runs[1]
