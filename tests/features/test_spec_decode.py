"""Speculative decoding's parts (issue 25): configuration, the n-gram index, and verification of
drafts, greedy (exact) and by rejection sampling (distribution-exact, by a frequency test)."""

from __future__ import annotations

import asyncio
import math
import re

import numpy as np
import pytest
import torch
from models import STRESS_ENGINE_ARGS, assert_same_greedy, stress_engine_args
from spec_drafts import FIXED_K, NGRAM, OracleProposer, draft_config, greedy_runs, oracle_drafts, spec_prompts

from cb_serve import LLM, SamplingParams
from cb_serve.config.speculative import SpeculativeConfig
from cb_serve.spec_decode.ngram import NgramIndex
from cb_serve.spec_decode.policy import StepCostCurve, choose_num_drafts, draft_gains
from cb_serve.spec_decode.speculator import SeqSpecState
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


# ---- in the engine: n-gram drafts verified in the ragged step ------------------------------------------------
@pytest.mark.parametrize(
    "arch, drafts",
    [
        ("llama", "oracle"),
        ("qwen2", "oracle"),
        ("mistral", "oracle"),
        ("qwen3", "oracle"),
        ("gemma3_text", "ngram"),  # a sliding-window model with n-gram drafts
        ("gemma4_text", "oracle"),  # KV-shared layers verifying drafts over their source layers' cache
        ("smollm2", "oracle"),
        ("smollm2", "adaptive"),  # n-gram drafts, adaptive k (fixed-k n-gram drafts: gemma3_text's case)
    ],
)
def test_greedy_with_drafts_equals_greedy_without(arch, drafts, random_model_dir, tokenizer, smol_llm):
    """Token for token (up to the top-2 tie rule of ``models.assert_same_greedy``) under the stress
    settings: chunked prefill, preemption and prefix hits all happen (checked), drafts are
    accepted and rejected, and every KV block comes back."""
    model = None if arch == "smollm2" else str(random_model_dir(arch))
    stress = stress_engine_args(arch)
    ref_llm = smol_llm if model is None else LLM(model, **stress)
    spec_llm = LLM(model, speculative_config=NGRAM if drafts == "adaptive" else FIXED_K, **stress)
    prompts = spec_prompts(tokenizer)
    ref, _ = greedy_runs(ref_llm, prompts)
    if drafts == "oracle":
        oracle_drafts(spec_llm, prompts, ref)
    before = spec_llm.engine.get_stats()
    steps = []
    spec_llm.engine.add_step_listener(lambda step, _outputs: steps.append(step))
    ours, _ = greedy_runs(spec_llm, prompts)
    assert_same_greedy(ours, ref, f"{arch} {drafts}")
    stats, counters = spec_llm.engine.get_stats(), spec_llm.engine.speculator.counters
    assert sum(s.num_draft_tokens for s in steps) == counters.num_draft_tokens  # what the metrics count
    assert sum(s.num_accepted_tokens for s in steps) == counters.num_accepted_tokens
    assert [sum(p) for p in zip(*(s.num_accepted_tokens_per_pos for s in steps))] == counters.accepted_per_pos
    shown = [q for record in spec_llm.engine.inspect("steps", limit=100_000) for q in record["seqs"]]  # the inspector
    assert sum(q["drafted"] for q in shown) == counters.num_draft_tokens
    assert sum(q["accepted"] for q in shown) <= counters.num_accepted_tokens  # a stop may end a run early
    assert all(q["kind"] == "decode" for q in shown if q["drafted"])
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, counters
    if drafts == "oracle":
        assert counters.accepted_per_pos[-1] > 0 and counters.accepted_per_pos[0] < counters.num_drafts, counters
    assert stats.num_preemptions > before.num_preemptions and stats.num_partial_prefills > before.num_partial_prefills
    assert stats.prefix_cache_hits > before.prefix_cache_hits
    assert spec_llm.engine.get_stats().kv_blocks_used == 0


def test_stops_inside_an_accepted_run_cut_it_there(random_model_dir, tokenizer):
    """A stop string or stop token met among a step's accepted drafts ends the output exactly where
    decoding without drafts ends it, with the same finish reason and stop reason."""
    model = str(random_model_dir("llama"))
    ref_llm, spec_llm = LLM(model, **STRESS_ENGINE_ARGS), LLM(model, speculative_config=FIXED_K, **STRESS_ENGINE_ARGS)
    prompts = spec_prompts(tokenizer)
    ref, plain = greedy_runs(ref_llm, prompts)
    oracle_drafts(spec_llm, prompts, ref)
    checked = 0
    for out, prompt in zip(plain, prompts):
        tokens = out.outputs[0].token_ids
        for cut in (10, 25):
            stop_token = tokens[cut]
            stop_text = tokenizer.decode(tokens[cut : cut + 2])
            for params in ({"stop_token_ids": [stop_token]}, {"stop": [stop_text]}):
                (ref_out,) = greedy_runs(ref_llm, [prompt], **params)[1]
                accepted = spec_llm.engine.speculator.counters.num_accepted_tokens
                (spec_out,) = greedy_runs(spec_llm, [prompt], **params)[1]
                a, b = spec_out.outputs[0], ref_out.outputs[0]
                assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                    b.token_ids,
                    b.text,
                    b.finish_reason,
                    b.stop_reason,
                ), params
                checked += spec_llm.engine.speculator.counters.num_accepted_tokens > accepted
    assert checked >= 4, "too few of these runs accepted drafts to exercise a stop among them"
    assert spec_llm.engine.get_stats().kv_blocks_used == 0


def test_sampled_and_greedy_requests_speculate_side_by_side(random_model_dir, tokenizer):
    """Greedy and seeded sampled requests in one batch, with drafts: the greedy ones equal plain
    greedy, the sampled ones are reproducible (two runs, the same tokens), and both accept drafts."""
    model = str(random_model_dir("llama"))
    prompts = spec_prompts(tokenizer)[:4]
    params = [
        SamplingParams(temperature=0, max_tokens=32),
        SamplingParams(temperature=0.8, seed=7, max_tokens=32),
        SamplingParams(temperature=0, max_tokens=32),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=32, n=2),
    ]
    plain = [o.outputs[0].token_ids for o in LLM(model, **STRESS_ENGINE_ARGS).generate(prompts, params, use_tqdm=False)]
    runs = []
    # n = 2: each completion its own sequence, drafts and seeded generator (seed + index)
    for _ in range(2):
        llm = LLM(model, speculative_config=NGRAM, **STRESS_ENGINE_ARGS)
        oracle_drafts(llm, prompts, [(tokens, None) for tokens in plain])
        runs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.speculator.counters.num_accepted_tokens > 0
    assert runs[0] == runs[1]  # seeded: reproducible with drafts
    assert runs[0][0] == [plain[0]] and runs[0][2] == [plain[2]]  # greedy: unchanged
    assert len(runs[0][3]) == 2 and runs[0][3][0] != runs[0][3][1]


def test_sampling_with_drafts_keeps_the_distribution(tokenizer, smol_llm):
    """SmolLM2 continuing a count at temperature 1: the second and third sampled tokens (the first
    ones drafts can touch) of 600 seeded requests follow the same distribution with drafts
    (rejection sampling; the drafts are the greedy continuation, often but not always accepted) as
    without: each token's two frequencies within 5 standard deviations of their pooled estimate (a
    false alarm has probability < 1e-6 per token compared, normal approximation)."""
    model = None
    prompt = tokenizer.encode("Counting: 1, 2, 3, 4, 5, 6, 7,")
    n = 600
    args = dict(max_model_len=128, num_gpu_blocks=1024, max_num_seqs=128, max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=3, ignore_eos=True) for seed in range(n)]
    greedy = smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    likely = greedy[0].outputs[0].token_ids
    outputs = {}
    for spec in (None, NGRAM):
        llm = LLM(model, speculative_config=spec, **args)
        if spec:
            llm.engine.speculator.proposer = OracleProposer({tuple(prompt): likely})
        outputs[spec is not None] = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]
        if spec:
            counters = llm.engine.speculator.counters
            assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, counters
    for position in (1, 2):
        plain = [tokens[position] for tokens in outputs[False]]
        drafted = [tokens[position] for tokens in outputs[True]]
        for token in set(plain) | set(drafted):
            a, b = plain.count(token) / n, drafted.count(token) / n
            pooled = (a + b) / 2
            assert abs(a - b) <= 5 * math.sqrt(pooled * (1 - pooled) * 2 / n) + 1e-12, (position, token, a, b)


@pytest.mark.parametrize(
    "target, draft",
    [("llama", "llama"), ("llama", "qwen2"), ("smollm2", "llama")],
    ids=["draft-is-target", "another-model", "smollm2-random-draft"],
)
def test_draft_model_greedy_equals_greedy_without(target, draft, random_model_dir, tokenizer, smol_llm):
    """A draft model with its own paged KV cache: the target itself (every draft right but where a
    stop or the budget cuts), or another model of the same tokenizer (mostly wrong). Greedy output
    equals plain greedy under chunked prefill, preemption and prefix hits; both caches are whole
    at the end, and the policy's own path (adaptive: k chosen before drafting) gives the same."""
    model = None if target == "smollm2" else str(random_model_dir(target))
    ref_llm = smol_llm if model is None else LLM(model, **STRESS_ENGINE_ARGS)
    prompts = spec_prompts(tokenizer)
    ref, _ = greedy_runs(ref_llm, prompts)
    for adaptive in (False, True):
        config = draft_config(str(random_model_dir(draft)), adaptive=adaptive)
        spec_llm = LLM(model, speculative_config=config, **STRESS_ENGINE_ARGS)
        before = spec_llm.engine.get_stats()
        ours, _ = greedy_runs(spec_llm, prompts)
        assert_same_greedy(ours, ref, f"{target} drafted by {draft}, adaptive={adaptive}")
        counters, stats = spec_llm.engine.speculator.counters, spec_llm.engine.get_stats()
        assert counters.num_draft_tokens > 0, counters
        if draft == target:
            assert counters.num_accepted_tokens > 0.9 * counters.num_draft_tokens, counters
        assert stats.num_preemptions > before.num_preemptions
        proposer = spec_llm.engine.speculator.proposer
        assert spec_llm.engine.get_stats().kv_blocks_used == 0
        assert proposer.blocks.num_used_blocks == 0 and not proposer.shadows


def test_self_draft_with_drafts_cut_by_the_budget(random_model_dir, tokenizer):
    """A budget of 16 tokens for 8 sequences cuts most drafts; the target then picks a cut draft
    itself, which the draft model had already computed: it recomputes that position (a serving
    test found the engine dying here) and the output equals plain greedy."""
    model = str(random_model_dir("llama"))
    args = {**STRESS_ENGINE_ARGS, "max_num_batched_tokens": 16}
    prompts = spec_prompts(tokenizer)
    ref, _ = greedy_runs(LLM(model, **args), prompts)
    spec_llm = LLM(model, speculative_config=draft_config(model, adaptive=False), **args)
    ours, _ = greedy_runs(spec_llm, prompts)
    assert_same_greedy(ours, ref, "self-drafted under a 16-token budget")
    assert spec_llm.engine.speculator.counters.num_accepted_tokens > 0
    assert spec_llm.engine.speculator.proposer.blocks.num_used_blocks == 0


def test_draft_model_must_share_the_tokenizer(random_model_dir, tmp_path):
    """A draft of another vocabulary is refused when the engine is built, naming the reason."""
    from models import make_random_model
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(random_model_dir("llama")))
    other.add_tokens([f"<extra_{i}>" for i in range(64)])
    draft = make_random_model(tmp_path / "other", "llama", other)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(random_model_dir("llama")), speculative_config=draft_config(str(draft)), max_model_len=128)


def flat_then_steep(knee: int, fixed_s: float = 0.02, per_token_s: float = 0.001) -> StepCostCurve:
    """A measured curve: bandwidth-bound (flat) up to ``knee`` tokens, then compute-bound."""
    curve = StepCostCurve()
    for n in sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, knee}):
        curve.observe(n, fixed_s + per_token_s * max(0, n - knee))
    return curve


def test_step_cost_curve_interpolates_and_extrapolates_what_it_measured():
    curve = StepCostCurve()
    assert curve.seconds(np.array([1, 10])) is None
    curve.observe(4, 0.02)
    assert curve.seconds(np.array([2, 4, 8])).tolist() == pytest.approx([0.02, 0.02, 0.02])  # flat: untried, so tried
    curve.observe(64, 0.08)
    assert curve.seconds(np.array([34, 124])).tolist() == pytest.approx([0.05, 0.08])  # the line, then flat
    curve.observe(66, 0.16)  # the same quarter octave: a decayed mean
    assert curve.points[24][1] == pytest.approx(0.8 * 0.08 + 0.2 * 0.16)


def test_policy_drafts_on_a_flat_step_and_stops_on_a_compute_bound_one():
    """k per sequence from load and acceptance: one sequence on the flat part of the curve keeps every
    draft worth anything; 64 sequences past the knee keep none of mediocre ones (k = 0); the tokens
    left under the knee go to the likeliest drafts, and no further (1 ms buys < 1 expected token
    there, the step makes more than that per ms)."""
    curve = flat_then_steep(knee=32)
    assert choose_num_drafts([draft_gains(0.3, [0.6, 0.6], 3)], 1, 1, curve) == [3]
    mediocre = [draft_gains(0.6, [0.7, 0.7, 0.7], 4)] * 64
    assert choose_num_drafts(mediocre, 64, 64, curve) == [0] * 64
    sure = [draft_gains(0.99, [0.5, 0.5, 0.5], 4)] * 64
    assert sorted(choose_num_drafts(sure, 64, 64, flat_then_steep(knee=96))) == [0] * 32 + [1] * 32
    mixed = choose_num_drafts([draft_gains(0.95, [0.95] * 3, 4), draft_gains(0.1, [0.5] * 3, 4)] * 8, 16, 16, curve)
    assert mixed == [2, 0] * 8
    assert draft_gains(0.5, [0.8, 0.9], 3) == pytest.approx([0.5, 0.4, 0.36])


def test_speculator_counts_acceptance_per_position(random_model_dir):
    """A sequence's first draft, and each later draft given the one before it, as trials; and a
    seeded sampled request keeps its drafts whatever the policy would choose (reproducible draws)."""
    llm = LLM(str(random_model_dir("llama")), speculative_config=NGRAM, max_model_len=128)
    spec = llm.engine.speculator
    for seed in (None, 5):
        params = SamplingParams(temperature=0 if seed is None else 1.0, seed=seed, max_tokens=16)
        llm.engine.add_request(f"r{seed}", [1, 2, 3, 1, 2, 3, 1, 2], params)
    llm.engine.step()  # both prompts in one step, a token each, no drafts yet
    seqs = list(llm.engine.scheduler.running)
    assert [s.num_output_tokens for s in seqs] == [1, 1] and spec.counters.num_drafts == 0
    for seq in seqs:
        seq.spec_state = SeqSpecState()
    spec.record(seqs[0], 4, 3)  # two of four accepted
    assert (spec.first_draft.accepted, spec.first_draft.trials) == (1, 1)
    assert [(e.accepted, e.trials) for e in spec.later_drafts] == [(1, 1), (0, 1), (0, 0)]
    assert spec.counters.accepted_per_pos == [1, 1, 0, 0]
    spec.cost = flat_then_steep(knee=6, per_token_s=1.0)  # the step: 2 decodes, 4 seeded drafts; any more costly
    spec.proposer = OracleProposer({(1, 2, 3, 1, 2, 3, 1, 2): list(range(10, 40))})
    spec.propose(seqs)
    assert [len(s.spec_token_ids) for s in seqs] == [0, 4]  # greedy: trimmed to none; seeded: kept
    llm.engine.abort_request(["rNone", "r5"])
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_a_sequence_keeping_no_drafts_probes_with_one_and_backs_off(random_model_dir):
    """Drafts priced out (each extra token costs a second): a sequence whose proposals are all cut keeps one on
    its 4th such step (a probe: otherwise it would never be measured again, and a text that starts repeating
    would never be drafted for); a rejected probe doubles the wait, an accepted one resets it."""
    llm = LLM(str(random_model_dir("llama")), speculative_config=NGRAM, max_model_len=128)
    spec = llm.engine.speculator
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    llm.engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=64))
    llm.engine.step()
    (seq,) = list(llm.engine.scheduler.running)
    spec.cost = flat_then_steep(knee=1, per_token_s=1.0)
    spec.proposer = OracleProposer({tuple(prompt): list(range(10, 40))})

    def kept(steps: int) -> list[int]:
        out = []
        for _ in range(steps):
            spec.propose([seq])
            out.append(len(seq.spec_token_ids))
        return out

    assert kept(4) == [0, 0, 0, 1]
    spec.record(seq, 1, 1)  # the probe rejected: 8 steps to the next
    assert kept(8) == [0] * 7 + [1]
    spec.record(seq, 1, 2)  # accepted: back to 4
    assert kept(4) == [0, 0, 0, 1]
    llm.engine.abort_request(["r"])
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_structured_outputs_speculate_under_their_grammar(random_model_dir):
    """Constrained requests with drafts (their reference continuation, one draft wrong per call):
    the grammar keeps only the drafts it admits, each position is verified under its own mask, and
    the greedy output equals constrained greedy without drafts, jump-forward included; a seeded
    sampled constrained request still matches its regex and is reproducible."""
    pytest.importorskip("llguidance")
    from test_structured_engine import CONSTRAINTS, PROMPTS

    model = str(random_model_dir("llama"))
    args = dict(max_model_len=256, num_gpu_blocks=64)
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in CONSTRAINTS]
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=40, structured_outputs=CONSTRAINTS[1])
    plain = LLM(model, **args).generate(PROMPTS + PROMPTS[1:2], params + [sampled], use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in plain]
    runs = []
    for _ in range(2):
        llm = LLM(model, speculative_config=FIXED_K, **args)
        llm.engine.speculator.proposer = OracleProposer({tuple(p): r for p, r in zip(PROMPTS, ref)})
        outs = llm.generate(PROMPTS + PROMPTS[1:2], params + [sampled], use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert [o.outputs[0].token_ids for o in outs[:3]] == ref[:3]
        assert [o.outputs[0].finish_reason for o in outs[:3]] == [o.outputs[0].finish_reason for o in plain[:3]]
        if outs[3].outputs[0].finish_reason == "stop":
            assert re.fullmatch(r"[a-z]{2,6}-\d{3}", outs[3].outputs[0].text)
        counters = llm.engine.speculator.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, counters
        assert llm.engine.get_stats().kv_blocks_used == 0
    assert runs[0] == runs[1]


def test_streamed_deltas_carry_every_accepted_token(random_model_dir, tokenizer):
    """AsyncLLM with DELTA outputs: a step that accepts drafts sends its tokens in one delta; the
    deltas joined are the whole greedy output."""
    from cb_serve import AsyncLLM, EngineConfig, RequestOutputKind

    model = str(random_model_dir("llama"))
    prompts = spec_prompts(tokenizer)[:3]
    ref, _ = greedy_runs(LLM(model, **STRESS_ENGINE_ARGS), prompts)
    llm = AsyncLLM(EngineConfig(model=model, speculative_config=FIXED_K, **STRESS_ENGINE_ARGS))
    llm.engine.speculator.proposer = OracleProposer({tuple(p): r for p, (r, _) in zip(prompts, ref)})
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def stream(i: int) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) async for o in llm.generate(prompts[i], params, f"s{i}")]

    async def main():
        return await asyncio.gather(*(stream(i) for i in range(len(prompts))))

    try:
        deltas = asyncio.run(main())
    finally:
        llm.shutdown()
    for (tokens, _), got in zip(ref, deltas):
        assert [t for d in got for t in d] == tokens
    assert max(len(d) for got in deltas for d in got) > 1


def test_a_draft_models_cache_shares_the_kv_memory_block_for_block():
    """``kv_cache_memory`` (or a device's free memory) holds both caches, as many blocks each."""
    from types import SimpleNamespace

    from cb_serve.config import EngineConfig
    from cb_serve.engine.kv_cache_sizing import kv_cache_bytes_per_block, num_kv_blocks

    hf = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    per_block = kv_cache_bytes_per_block(hf, 16, torch.float32)
    config = EngineConfig(kv_cache_memory=100 * per_block)
    args = (config, hf, 16, 64, torch.float32, torch.float32, torch.device("cpu"))
    assert num_kv_blocks(*args) == 100
    assert num_kv_blocks(*args, per_block // 4) == 80  # a draft with a quarter of the KV per token


def test_blocks_that_held_rejected_drafts_are_cached_with_the_right_kv(random_model_dir, tokenizer):
    """The prefix cache keeps only what the target computed: after outputs whose blocks held
    rejected drafts (KV written, then overwritten by the emitted tokens'), each prompt + output is
    sent again; it hits those blocks and its continuation equals a cache-less engine's, and every
    cached block's tokens are its sequence's own."""
    model = str(random_model_dir("llama"))
    args = dict(block_size=16, max_model_len=400, num_gpu_blocks=200)
    prompts = spec_prompts(tokenizer)[:4]
    ref_llm = LLM(model, enable_prefix_caching=False, **args)
    ref, _ = greedy_runs(ref_llm, prompts)
    spec_llm = LLM(model, speculative_config=FIXED_K, **args)
    oracle_drafts(spec_llm, prompts, ref)
    greedy_runs(spec_llm, prompts)
    counters = spec_llm.engine.speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, counters
    again = [p + tokens[:64] for p, (tokens, _) in zip(prompts, ref)]
    before = spec_llm.engine.get_stats().prefix_cache_hits
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in spec_llm.generate(again, params, use_tqdm=False)]
    theirs = [o.outputs[0].token_ids for o in ref_llm.generate(again, params, use_tqdm=False)]
    assert ours == theirs
    hits = spec_llm.engine.get_stats().prefix_cache_hits - before
    assert hits >= sum((len(p) + 48) // 16 * 16 for p in prompts), hits  # the output's blocks too
    sequences = [p + t for p, (t, _) in zip(prompts, ref)] + [a + t for a, t in zip(again, ours)]
    known = {tuple(s[i : i + 16]) for s in sequences for i in range(0, len(s) - 15, 16)}
    bm = spec_llm.engine.block_manager
    cached = [bm.block_tokens(b) for b in bm.cached.values()]
    assert cached and all(t in known for t in cached)
