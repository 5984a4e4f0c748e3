"""The sampler against independent oracles:

- the filtered, renormalized distribution (temperature, min-p, top-k, top-p, alone and combined,
  applied in vLLM's order) equals what HF transformers' logits warpers give;
- seeded draws follow that distribution within a stated statistical bound;
- logprobs equal a ``log_softmax`` of the logits HF transformers computes for the same tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cb_serve import SamplingParams
from cb_serve.model_executor.sampler import Sampler, SamplingBatch
from cb_serve.sequence import Sequence

VOCAB = 64
DEFAULTS = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
SETTINGS = [
    dict(temperature=0.5),
    dict(temperature=1.7),
    dict(top_k=5),
    dict(top_k=1),
    dict(top_k=0),  # off, like -1
    dict(top_p=0.8),
    dict(min_p=0.05),
    dict(temperature=0.7, top_k=12, top_p=0.9),
    dict(temperature=1.3, min_p=0.02, top_p=0.7),
    dict(temperature=0.9, top_k=30, top_p=0.95, min_p=0.03),
    dict(top_k=VOCAB + 10, top_p=0.5),  # top-k above the vocabulary: off
]


def batch_of(settings: list[dict], generators=None) -> SamplingBatch:
    full = [{**DEFAULTS, **s} for s in settings]
    return SamplingBatch(
        temperature=torch.tensor([s["temperature"] for s in full]),
        top_k=torch.tensor([s["top_k"] for s in full], dtype=torch.int64),
        top_p=torch.tensor([s["top_p"] for s in full]),
        min_p=torch.tensor([s["min_p"] for s in full]),
        generators=generators or [None] * len(full),
        num_logprobs=[None] * len(full),
        banned=[],
        all_greedy=False,
    )


def hf_distribution(logits: torch.Tensor, setting: dict) -> torch.Tensor:
    """HF's warpers in vLLM's order of application (temperature, min-p, top-k, top-p)."""
    s = {**DEFAULTS, **setting}
    warpers = [TemperatureLogitsWarper(s["temperature"])]
    if s["min_p"] > 0:
        warpers.append(MinPLogitsWarper(s["min_p"]))
    if 0 < s["top_k"] < VOCAB:
        warpers.append(TopKLogitsWarper(s["top_k"]))
    if s["top_p"] < 1:
        warpers.append(TopPLogitsWarper(s["top_p"]))
    scores = logits[None].clone()
    input_ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in warpers:
        scores = warper(input_ids, scores)
    return scores.softmax(-1)[0]


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_filtered_distribution_equals_hf_warpers(setting):
    logits = random_logits(16)
    ours = Sampler.probabilities(logits.clone(), batch_of([setting] * 16))
    for row in range(16):
        expected = hf_distribution(logits[row], setting)
        assert torch.allclose(ours[row], expected, atol=1e-6), f"row {row}"
        assert torch.equal(ours[row] > 0, expected > 0), f"row {row}: a different set of tokens survives"


def test_min_p_keeps_tokens_exactly_at_the_threshold():
    """``min_p=1`` keeps exactly the tokens tied at the maximum probability (HF's ``<`` rule)."""
    logits = torch.tensor([2.0, 0.0, 2.0, 1.0] + [-1.0] * (VOCAB - 4))
    ours = Sampler.probabilities(logits[None].clone(), batch_of([dict(min_p=1.0)]))[0]
    expected = hf_distribution(logits, dict(min_p=1.0))
    assert torch.allclose(ours, expected, atol=1e-6) and (ours > 0).nonzero().flatten().tolist() == [0, 2]


def test_each_row_of_a_mixed_batch_gets_its_own_filters():
    logits = random_logits(len(SETTINGS), seed=1)
    ours = Sampler.probabilities(logits.clone(), batch_of(SETTINGS))
    for row, setting in enumerate(SETTINGS):
        assert torch.allclose(ours[row], hf_distribution(logits[row], setting), atol=1e-6), setting


def test_seeded_and_unseeded_draws_follow_the_distribution():
    """40,000 draws of one row (every filter on, at least 5 tokens left), once each from its own
    seeded generator (as a seeded request draws) and once from the global generator. Bound: every
    token's frequency is within 5 standard deviations of its HF probability (a correct sampler fails
    one token's check with probability < 6e-7, all 64 with < 4e-5; the seeds are fixed, so the run is
    deterministic), and filtered-out tokens never appear."""
    setting = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    logits = random_logits(1, seed=2)[0] / 3
    expected = hf_distribution(logits, setting)
    assert int((expected > 0).sum()) >= 5, "too few tokens survive: the check would be weak"
    rows = 40_000
    seeded = [torch.Generator().manual_seed(seed) for seed in range(rows)]
    torch.manual_seed(0)
    for generators in (seeded, None):
        ids = Sampler()(logits.repeat(rows, 1), batch_of([setting] * rows, generators)).token_ids
        freq = torch.bincount(torch.tensor(ids), minlength=VOCAB).double() / rows
        assert freq[expected == 0].sum() == 0, "a filtered-out token was sampled"
        for token in torch.nonzero(expected).flatten().tolist():
            p = expected[token].item()
            bound = 5 * math.sqrt(p * (1 - p) / rows)
            assert abs(freq[token].item() - p) <= bound, f"token {token}: {freq[token]:.4f} vs {p:.4f} (±{bound:.4f})"


def test_a_seeded_row_draws_the_same_whatever_its_neighbours():
    logits = random_logits(4, seed=3) / 3
    mine = torch.Generator().manual_seed(42)
    alone = Sampler()(logits[:1].clone(), batch_of([{}], [mine])).token_ids[0]
    picks = set()
    for neighbours in range(1, 4):
        rows = 1 + neighbours
        gens = [torch.Generator().manual_seed(42)] + [None] * neighbours
        picks.add(Sampler()(logits[:rows].clone(), batch_of([{}] * rows, gens)).token_ids[0])
    assert picks == {alone}
    draws = {
        Sampler()(logits[:1].clone(), batch_of([{}], [torch.Generator().manual_seed(s)])).token_ids[0]
        for s in range(40)
    }
    assert len(draws) > 1, "different seeds draw differently"


def test_greedy_rows_take_the_first_maximum_in_mixed_and_all_greedy_batches():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]] * 64)
    all_greedy = batch_of([dict(temperature=0.0)] * 64)
    all_greedy.all_greedy = True
    assert Sampler()(logits.clone(), all_greedy).token_ids == [1] * 64
    mixed = batch_of([dict(temperature=0.0), dict(temperature=1.0)] * 32)
    torch.manual_seed(0)
    ids = Sampler()(logits.clone(), mixed).token_ids
    assert ids[0::2] == [1] * 32, "a greedy row in a sampled batch"
    assert len(set(ids[1::2])) > 1, "the sampled rows were greedy"


def test_logprobs_equal_an_independent_log_softmax(tiny_llm, random_model_dir):
    """Sampled (not greedy) so that sampled tokens outside the top-k appear: each reported
    logprob, the top-k set and every rank match log_softmax of HF's float32 logits."""
    k = 4
    params = SamplingParams(temperature=1.5, seed=11, max_tokens=12, logprobs=k, ignore_eos=True)
    prompt = list(range(300, 340))
    out = tiny_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(random_model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].double()
    ref = logits.log_softmax(-1)[len(prompt) - 1 : -1]  # the distribution each output token was drawn from
    tokenizer = tiny_llm.get_tokenizer()
    outside_top_k = 0
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = ref[j].topk(k).indices.tolist()
        assert set(entry) == set(top) | {token}, f"token {j}: the top-{k} set differs"
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[j, t].item(), abs=1e-4), f"token {j}, id {t}"
            # The rank: 1 + the tokens above it, up to those within the tolerance (near ties, which another
            # GEMM call sequence may order otherwise: one did under torch's scalar kernels and MKL_CBWR).
            above, near = int((ref[j] > lp.logprob + 1e-4).sum()), int((ref[j] > lp.logprob - 1e-4).sum())
            assert above + 1 <= lp.rank <= near + 1, f"token {j}, id {t}: rank"
            assert lp.decoded_token == tokenizer.decode([t])
        outside_top_k += token not in top
    assert outside_top_k, "every sampled token was in the top-k: the test would not see the extra entry"
    assert out.cumulative_logprob == pytest.approx(ref[range(len(out.token_ids)), out.token_ids].sum().item(), abs=1e-3)


def test_sampling_batch_from_sequences():
    """Each sequence's parameters land in its own row, with the right dtypes; ``min_tokens`` bans
    name the row; a batch is all-greedy only when every row is."""
    greedy = SamplingParams(temperature=0, max_tokens=5)
    sampled = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.1, min_tokens=2, max_tokens=5, seed=4)
    sampled_lp = SamplingParams(temperature=1.0, max_tokens=5, logprobs=2)
    seqs = [
        Sequence("g", "g", 0, [1, 2], greedy, 5, min_tokens_banned=[9]),
        Sequence("s", "s", 0, [1, 2], sampled, 5, min_tokens_banned=[7, 3]),
        Sequence("l", "l", 0, [1, 2], sampled_lp, 5),
    ]
    batch = SamplingBatch.from_seqs(seqs)
    assert batch.temperature.dtype == torch.float32 and batch.top_p.dtype == torch.float32
    assert batch.min_p.dtype == torch.float32 and batch.top_k.dtype == torch.int64
    assert batch.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert batch.top_k.tolist() == [-1, 3, -1]
    assert batch.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert batch.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert batch.banned == [(1, [3, 7])]  # the greedy row has no min_tokens: nothing banned
    assert batch.generators[0] is None and batch.generators[1] is seqs[1].generator is not None
    assert batch.num_logprobs == [None, None, 2]
    assert batch.all_greedy is False
    assert SamplingBatch.from_seqs(seqs[:1]).all_greedy is True


def test_banned_tokens_are_never_picked_and_logprobs_see_them():
    """A ``min_tokens`` ban removes the token from greedy and random picks alike, while the
    logprobs (of the unfiltered distribution) still rank it first."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5]] * 3)
    batch = batch_of([dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=1)])
    batch.banned = [(0, [1]), (1, [1]), (2, [1])]
    batch.num_logprobs = [1, None, 0]
    torch.manual_seed(0)
    out = Sampler()(logits.clone(), batch)
    assert out.token_ids[0] == 2 and out.token_ids[2] == 2 and out.token_ids[1] != 1
    assert set(out.logprobs[0]) == {1, 2} and out.logprobs[0][1].rank == 1 and out.logprobs[0][2].rank == 2
    assert out.logprobs[1] is None
    assert set(out.logprobs[2]) == {2} and out.logprobs[2][2].rank == 2  # logprobs=0: the sampled token alone
