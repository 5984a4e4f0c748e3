"""Prefix caching on hybrid models (``engine/state_snapshots.py``): multi-turn conversations whose later
turns resume from the recurrent states kept at the previous turn's last full block, under the stress
settings (chunked prefill, a KV pool small enough to preempt) with requests aborted mid-turn, give HF's
greedy tokens; the hits are asserted, and every block, slot and pending snapshot comes back."""

from __future__ import annotations

import random

import pytest
from models import STRESS_ENGINE_ARGS, assert_greedy_match, hf_greedy
from observe import counter_deltas

from cb_serve import LLM, SamplingParams

NUM_CONVERSATIONS = 5
NUM_TURNS = 3


def run_turn(engine, prompts: list[list[int]], max_tokens: list[int], rng: random.Random) -> list[list[int]]:
    """Greedy outputs of ``prompts`` through the engine's own API, with as many bystanders added beside them
    and aborted at random steps (queued, mid-prefill or mid-decode)."""
    outputs: dict[str, list[int]] = {}
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"c{i}", prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        noise = [rng.randrange(100, 4000) for _ in range(rng.randint(40, 120))]
        sampled = SamplingParams(max_tokens=30, seed=i)  # seeded: the same run every time
        engine.add_request(f"x{i}", prompt[: rng.randint(1, len(prompt))] + noise, sampled)
    bystanders = [f"x{i}" for i in range(len(prompts))]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        if bystanders and rng.random() < 0.3:
            engine.abort_request(bystanders.pop(rng.randrange(len(bystanders))))
        engine.check_invariants()
    return [outputs[f"c{i}"] for i in range(len(prompts))]


# Async scheduling registers a decode's snapshot a step late (its token lands then); tensor-parallel ranks
# each copy their shard of the states.
@pytest.mark.parametrize(
    "arch, args",
    [
        ("qwen3_5_text", {}),
        ("qwen3_next", {}),
        ("granitemoehybrid", {}),
        ("qwen3_5_text", {"async_scheduling": True}),
        ("qwen3_next", {"tensor_parallel_size": 2}),
    ],
    ids=["qwen3_5_text", "qwen3_next", "granitemoehybrid", "qwen3_5_text-async", "qwen3_next-tp2"],
)
def test_later_turns_resume_from_kept_states_and_match_hf(arch, args, random_model_dir):
    model = random_model_dir(arch)
    rng = random.Random(arch)
    llm = LLM(str(model), **STRESS_ENGINE_ARGS, **args)
    engine = llm.engine
    try:
        prompts = [[rng.randrange(100, 4000) for _ in range(rng.randint(40, 100))] for _ in range(NUM_CONVERSATIONS)]
        hits = preemptions = 0
        for turn in range(NUM_TURNS):
            max_tokens = [rng.randint(8, 24) for _ in prompts]
            with counter_deltas(engine) as deltas:
                ours = run_turn(engine, prompts, max_tokens, rng)
            for i, ((ref, logits), got) in enumerate(zip(hf_greedy(model, prompts, max_tokens), ours)):
                assert_greedy_match(got, ref, logits, f"{arch} turn {turn} conversation {i}")
            if turn:
                assert deltas["prefix_cache_hits"] > 0, f"turn {turn} resumed no conversation"
            hits, preemptions = hits + deltas["prefix_cache_hits"], preemptions + deltas["num_preemptions"]
            follow_ups = [[rng.randrange(100, 4000) for _ in range(rng.randint(5, 30))] for _ in prompts]
            prompts = [p + o + f for p, o, f in zip(prompts, ours, follow_ups)]
        assert preemptions > 0, "nothing was preempted"
        stats = engine.get_stats()
        assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0, "a block or slot leaked"
        assert stats.state_snapshots_total == STRESS_ENGINE_ARGS["max_num_seqs"] and stats.state_snapshots_used > 0
        print(f"{arch}: {hits} prompt tokens resumed over {NUM_TURNS} turns, {preemptions} preemptions")
    finally:
        engine.shutdown()
