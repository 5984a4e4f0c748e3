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

VOCAB = 64
DEFAULTS = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)
SETTINGS = [
    dict(temperature=0.5),
    dict(temperature=1.7),
    dict(top_k=5),
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


def test_each_row_of_a_mixed_batch_gets_its_own_filters():
    logits = random_logits(len(SETTINGS), seed=1)
    ours = Sampler.probabilities(logits.clone(), batch_of(SETTINGS))
    for row, setting in enumerate(SETTINGS):
        assert torch.allclose(ours[row], hf_distribution(logits[row], setting), atol=1e-6), setting


def test_seeded_draws_follow_the_distribution():
    """40,000 draws of one row (every filter on), each from its own seeded generator as a seeded
    request draws. Bound: every token's frequency is within 5 standard deviations of its HF
    probability (a correct sampler fails one token's check with probability < 6e-7, all 64 with
    < 4e-5; the seeds are fixed, so the run is deterministic), and filtered-out tokens never appear."""
    setting = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    logits = random_logits(1, seed=2)[0]
    expected = hf_distribution(logits, setting)
    rows = 40_000
    generators = [torch.Generator().manual_seed(seed) for seed in range(rows)]
    ids = Sampler()(logits.repeat(rows, 1), batch_of([setting] * rows, generators)).token_ids
    freq = torch.bincount(torch.tensor(ids), minlength=VOCAB).double() / rows
    assert freq[expected == 0].sum() == 0, "a filtered-out token was sampled"
    for token in torch.nonzero(expected).flatten().tolist():
        p = expected[token].item()
        bound = 5 * math.sqrt(p * (1 - p) / rows)
        assert abs(freq[token].item() - p) <= bound, f"token {token}: {freq[token]:.4f} vs p={p:.4f} (±{bound:.4f})"


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
            assert lp.rank == 1 + int((ref[j] > ref[j, t]).sum()), f"token {j}, id {t}: rank"
            assert lp.decoded_token == tokenizer.decode([t])
        outside_top_k += token not in top
    assert outside_top_k, "every sampled token was in the top-k: the test would not see the extra entry"
    assert out.cumulative_logprob == pytest.approx(ref[range(len(out.token_ids)), out.token_ids].sum().item(), abs=1e-3)
