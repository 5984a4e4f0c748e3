"""Speculative decoding on hybrid models (issue 55): a verify step keeps each draft position's recurrent state
(``recurrent_rows.VerifyPosition``) and the next step begins from the last accepted one's
(``StateCache.verified``). Greedy tokens with drafts (known continuations with a wrong draft at a moving place,
and a draft model) equal those without, under the stress settings with prefix caching on; a soak with aborts
returns every block, slot and snapshot."""

from __future__ import annotations

import pytest
from models import STRESS_ENGINE_ARGS, assert_same_greedy
from spec_drafts import FIXED_K, NGRAM, draft_config, greedy_runs, oracle_drafts, soak, spec_prompts

from cb_serve import LLM

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
# the policy choosing k; draft: a random draft model; ngram: the engine's own prompt lookup (k fixed). TP: each
# rank rolls back its shard of the states. (Speculative decoding turns async scheduling off.)
@pytest.mark.parametrize(
    "arch, drafts, args",
    [
        ("qwen3_5_text", "oracle", {}),
        ("qwen3_next", "oracle", {}),
        ("granitemoehybrid", "oracle", {}),
        ("qwen3_5_text", "draft", {}),
        ("qwen3_next", "oracle", {"tensor_parallel_size": 2}),
        ("granitemoehybrid", "adaptive", {}),
        ("qwen3_next", "ngram", {}),
    ],
    ids=[
        "qwen3_5_text", "qwen3_next", "granitemoehybrid", "qwen3_5_text-draft", "qwen3_next-tp2", "granite-adaptive",
        "qwen3_next-ngram",
    ],
)  # fmt: skip
def test_greedy_with_drafts_equals_greedy_without(arch, drafts, args, references, random_model_dir, tokenizer):
    model = str(random_model_dir(arch))
    prompts, ref = spec_prompts(tokenizer), references(arch)
    configs = {"oracle": FIXED_K, "adaptive": NGRAM, "ngram": FIXED_K}
    spec = configs.get(drafts) or draft_config(str(random_model_dir("llama")), adaptive=False)
    llm = LLM(model, speculative_config=spec, **STRESS_ENGINE_ARGS, **args)
    try:
        if drafts in ("oracle", "adaptive"):
            oracle_drafts(llm, prompts, ref)
        before = llm.engine.get_stats()
        ours, _ = greedy_runs(llm, prompts, max_tokens=MAX_TOKENS)
        assert_same_greedy(ours, ref, f"{arch} {drafts} {args}")
        counters, stats = llm.engine.speculator.counters, llm.engine.get_stats()
        assert 0 < counters.num_draft_tokens and counters.num_accepted_tokens < counters.num_draft_tokens, counters
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
    prompts, ref = spec_prompts(tokenizer), references(arch)
    llm = LLM(str(random_model_dir(arch)), speculative_config=FIXED_K, **STRESS_ENGINE_ARGS)
    try:
        oracle_drafts(llm, prompts, ref)
        assert soak(llm.engine, prompts, ref, MAX_TOKENS).num_preemptions > 0
        counters = llm.engine.speculator.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    finally:
        llm.engine.shutdown()


def test_next_turn_resumes_from_a_state_kept_inside_a_verify_window(random_model_dir, tokenizer, references):
    """Every decode step verifies drafts, so the block boundaries a conversation's answer crosses fall inside verify
    windows: the state there is saved from its verify slot once the draft is kept. The next turn resumes past the
    first turn's prompt, from such a state, and its greedy tokens equal a fresh engine's."""
    arch = "qwen3_5_text"
    model = str(random_model_dir(arch))
    prompts, ref = spec_prompts(tokenizer)[:3], references(arch)[:3]
    llm = LLM(model, speculative_config=FIXED_K, **STRESS_ENGINE_ARGS)
    try:
        oracle_drafts(llm, prompts, ref)
        first, _ = greedy_runs(llm, prompts, max_tokens=MAX_TOKENS)
        assert_same_greedy(first, ref, "first turn")
        turns = [p + list(tokens) + [1000 + i, 2000 + i] for i, (p, (tokens, _)) in enumerate(zip(prompts, first))]
        ours, outs = greedy_runs(llm, turns, max_tokens=16)
        for prompt, out in zip(prompts, outs):
            assert out.num_cached_tokens > len(prompt), (out.num_cached_tokens, len(prompt))
    finally:
        llm.engine.shutdown()
    fresh = LLM(model, **STRESS_ENGINE_ARGS)
    try:
        assert_same_greedy(ours, greedy_runs(fresh, turns, max_tokens=16)[0], "the next turn")
    finally:
        fresh.engine.shutdown()
