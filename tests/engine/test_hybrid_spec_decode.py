"""Speculative decoding on hybrid models (issue 55): a verify step keeps each draft position's recurrent state
(``recurrent_rows.VerifyPosition``) and the next step begins from the last accepted one's
(``StateCache.verified``). Greedy tokens with drafts (known continuations with a wrong draft at a moving place,
and a draft model) equal those without, under the stress settings with prefix caching on; a soak with aborts
returns every block, slot and snapshot."""

from __future__ import annotations

import random

import pytest
from models import STRESS_ENGINE_ARGS, assert_same_greedy
from spec_drafts import FIXED_K, NGRAM, draft_config, greedy_runs, oracle_drafts, spec_prompts

from cb_serve import LLM, SamplingParams

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def references(random_model_dir, tokenizer):
    """Each architecture's greedy outputs without drafts, computed once."""
    made: dict[str, list] = {}

    def get(arch: str) -> list:
        if arch not in made:
            llm = LLM(str(random_model_dir(arch)), **STRESS_ENGINE_ARGS)
            made[arch] = greedy_runs(llm, spec_prompts(tokenizer), max_tokens=MAX_TOKENS)[0]
            llm.engine.shutdown()
        return made[arch]

    return get


# oracle: known continuations, one draft wrong at a moving place, every draft verified; adaptive: the same drafts,
# the policy choosing k; draft: a random draft model. TP: each rank rolls back its shard of the states; async: a
# rollback joins a step launched ahead.
@pytest.mark.parametrize(
    "arch, drafts, args",
    [
        ("qwen3_5_text", "oracle", {}),
        ("qwen3_next", "oracle", {}),
        ("granitemoehybrid", "oracle", {}),
        ("qwen3_5_text", "draft", {}),
        ("qwen3_next", "oracle", {"tensor_parallel_size": 2}),
        ("granitemoehybrid", "adaptive", {"async_scheduling": True}),
    ],
    ids=["qwen3_5_text", "qwen3_next", "granitemoehybrid", "qwen3_5_text-draft", "qwen3_next-tp2", "granite-async"],
)
def test_greedy_with_drafts_equals_greedy_without(arch, drafts, args, references, random_model_dir, tokenizer):
    model = str(random_model_dir(arch))
    prompts, ref = spec_prompts(tokenizer), references(arch)
    configs = {"oracle": FIXED_K, "adaptive": NGRAM}
    spec = configs.get(drafts) or draft_config(str(random_model_dir("llama")), adaptive=False)
    llm = LLM(model, speculative_config=spec, **STRESS_ENGINE_ARGS, **args)
    try:
        if drafts in configs:
            oracle_drafts(llm, prompts, ref)
        before = llm.engine.get_stats()
        ours, _ = greedy_runs(llm, prompts, max_tokens=MAX_TOKENS)
        assert_same_greedy(ours, ref, f"{arch} {drafts} {args}")
        counters, stats = llm.engine.speculator.counters, llm.engine.get_stats()
        assert counters.num_accepted_tokens < counters.num_draft_tokens, counters  # a random draft: rarely right
        if drafts == "oracle":  # every draft kept, and none, both happen
            assert counters.accepted_per_pos[-1] > 0 and counters.accepted_per_pos[0] < counters.num_drafts, counters
        assert stats.num_preemptions > before.num_preemptions and stats.prefix_cache_hits > before.prefix_cache_hits
        assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    finally:
        llm.engine.shutdown()


def test_soak_with_rejections_aborts_and_preemption_returns_everything(random_model_dir, tokenizer, references):
    """Greedy and seeded sampled requests with drafts, a third aborted at random steps (queued, prefilling,
    verifying), on a pool small enough to preempt: the greedy survivors equal their references, the invariants
    hold at every step, and every KV block, state slot and pending snapshot comes back."""
    arch = "qwen3_5_text"
    model = str(random_model_dir(arch))
    prompts, ref = spec_prompts(tokenizer), references(arch)
    llm = LLM(model, speculative_config=FIXED_K, **STRESS_ENGINE_ARGS)
    engine, rng = llm.engine, random.Random(55)
    try:
        oracle_drafts(llm, prompts, ref)
        for rnd in range(3):
            ids = []
            for i, prompt in enumerate(prompts):
                greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
                sampled = SamplingParams(temperature=0.9, seed=i, max_tokens=MAX_TOKENS)
                engine.add_request(f"g{rnd}-{i}", prompt, greedy)
                engine.add_request(f"s{rnd}-{i}", prompt, sampled)
                ids += [f"g{rnd}-{i}", f"s{rnd}-{i}"]
            doomed, done = set(rng.sample(ids, len(ids) // 3)), {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0]
                if doomed and rng.random() < 0.4:
                    engine.abort_request(doomed.pop())
                engine.check_invariants()
            for i in range(len(prompts)):
                got = done.get(f"g{rnd}-{i}")
                if got is not None and got.finish_reason == "length":
                    assert_same_greedy([(got.token_ids, got.logprobs)], [ref[i]], f"soak round {rnd} prompt {i}")
        counters, stats = engine.speculator.counters, engine.get_stats()
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens and stats.num_preemptions > 0
        assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
        assert stats.state_snapshots_used <= stats.state_snapshots_total
    finally:
        engine.shutdown()
