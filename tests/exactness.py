"""The shared exactness harness: greedy outputs against HF transformers' ``generate`` token for
token (float32, CPU) on a workload that makes the engine chunk prompts, preempt, hit the prefix
cache and meet prompt lengths that are not multiples of the block size (``STRESS_ENGINE_ARGS``).

Tie rule: where HF's two best logits are within float rounding (1e-3), a divergence is
accepted only if our token is HF's second choice (see ``models.assert_greedy_match``)."""

from __future__ import annotations

import random

from models import STRESS_ENGINE_ARGS, assert_greedy_match, hf_greedy
from observe import counter_deltas

from cb_serve import LLM, SamplingParams

PROMPT_LENGTHS = [1, 3, 17, 31, 48, 64, 77, 100, 129, 150, 181, 200, 233, 260, 287, 300]
SHARED_PREFIX = 70  # tokens shared by several prompts: 4 full blocks of 16


def make_prompts(token_pool: list[int], seed: int) -> tuple[list[list[int]], list[int]]:
    """16 prompts of PROMPT_LENGTHS plus 4 that share a prefix with an earlier one: two its first
    ``SHARED_PREFIX`` tokens (a system prompt), two all of it (the next turn of a conversation: where a
    hybrid model keeps its recurrent states, ``engine/state_snapshots.py``)."""
    rng = random.Random(seed)
    prompts = []
    for n in PROMPT_LENGTHS:
        start = rng.randrange(len(token_pool) - n)
        prompts.append(token_pool[start : start + n])
    for i, n in enumerate([90, 120, 75, 200]):  # arrive after prompt 7 (len 100) was computed
        base = prompts[7 + (i % 2) * 4]
        shared = len(base) if i in (1, 2) else SHARED_PREFIX  # a later turn of its conversation, or a system prompt
        suffix = token_pool[rng.randrange(len(token_pool) - n) :][: n - SHARED_PREFIX]
        prompts.append(base[:shared] + suffix)
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    return prompts, max_tokens


def check_engine_exercised(llm: LLM, prompts: list[list[int]], deltas: dict[str, int]) -> None:
    """This run (not an earlier test on the same session engine) chunked, preempted and hit the cache."""
    bs = STRESS_ENGINE_ARGS["block_size"]
    assert deltas["num_partial_prefills"] > 0, "no prompt was chunked"
    assert deltas["num_preemptions"] > 0, "no sequence was preempted"
    if llm.engine.config.enable_prefix_caching:
        assert deltas["prefix_cache_hits"] > 0, "no prefix-cache hit"
    assert any(len(p) % bs for p in prompts) and any(len(p) > bs for p in prompts)
    assert max(len(p) for p in prompts) > STRESS_ENGINE_ARGS["max_num_batched_tokens"]


def run_and_compare(
    llm: LLM, hf_model, prompts: list[list[int]], max_tokens: list[int], label: str, stop_at_eos: bool, ref=None
) -> dict[str, int]:
    """Greedy outputs against HF's (``ref``: HF's outputs when already computed); returns how the
    engine's counters moved during the run."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=not stop_at_eos) for m in max_tokens]
    with counter_deltas(llm.engine) as deltas:
        ours = llm.generate(prompts, params, use_tqdm=False)
    ref = ref or hf_greedy(hf_model, prompts, max_tokens, stop_at_eos=stop_at_eos)
    identical = [
        assert_greedy_match(o.outputs[0].token_ids, r_tokens, r_logits, f"{label} prompt {i} (len {len(p)})")
        for i, (o, p, (r_tokens, r_logits)) in enumerate(zip(ours, prompts, ref))
    ]
    print(f"{label}: {sum(identical)}/{len(identical)} identical, the rest diverged at a rounding tie")
    assert sum(identical) >= len(identical) - 2, f"{label}: too many tie divergences: {identical}"
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0, "blocks or state slots leaked"
    return deltas
