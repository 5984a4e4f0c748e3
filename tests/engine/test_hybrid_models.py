"""Hybrid models beyond the ``ARCHS`` defaults, and their state slots under churn.

- A Granite 4 hybrid without position embedding (NoPE), without experts, and with one B/C group, against
  HF under the stress settings.
- A soak of requests added and aborted at random points (queued, mid-prefill, mid-decode, preempted):
  every state slot and KV block comes back, and witness requests that ran through the churn decode what
  they decode alone (a reused slot carries nothing over). ``CB_SERVE_SOAK_STEPS`` makes it longer.
"""

from __future__ import annotations

import os
import random

import pytest
from exactness import check_engine_exercised, make_prompts, run_and_compare
from models import STRESS_ENGINE_ARGS, make_random_model
from observe import counter_deltas

from cb_serve import LLM, SamplingParams

SOAK_STEPS = int(os.environ.get("CB_SERVE_SOAK_STEPS", "300"))
NOPE_DENSE = dict(position_embedding_type=None, num_local_experts=0, mamba_n_groups=1)


@pytest.fixture(scope="module")
def granite_dense_dir(tmp_path_factory, tokenizer):
    return make_random_model(tmp_path_factory.mktemp("granite_nope"), "granitemoehybrid", tokenizer, **NOPE_DENSE)


def test_a_granite_hybrid_without_rope_or_experts_matches_hf(granite_dense_dir):
    llm = LLM(str(granite_dense_dir), **STRESS_ENGINE_ARGS)
    try:
        prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=7)
        deltas = run_and_compare(llm, granite_dense_dir, prompts, max_tokens, "granite NoPE dense", False)
        check_engine_exercised(llm, prompts, deltas)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid"])
def test_state_slots_come_back_after_a_soak_with_aborts(arch, random_model_dir):
    model = str(random_model_dir(arch))
    args = dict(STRESS_ENGINE_ARGS, max_num_seqs=4, num_gpu_blocks=25)  # slots reused; blocks short: preemption
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    witnesses = [list(range(200 + 7 * i, 260 + 11 * i)) for i in range(3)]
    llm = LLM(model, **args)
    try:
        alone = [o.outputs[0].token_ids for o in llm.generate(witnesses, greedy, use_tqdm=False)]
        engine, rng = llm.engine, random.Random(0)
        live: set[str] = set()
        outputs: dict[str, list[int]] = {}
        for i, w in enumerate(witnesses):
            engine.add_request(f"w{i}", w, greedy)
        with counter_deltas(engine) as deltas:
            churn(engine, rng, live, outputs)
        stats = engine.get_stats()
        assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0, "a slot or block leaked"
        assert deltas["num_preemptions"] > 0, "nothing was preempted"
        assert [outputs[f"w{i}"] for i in range(3)] == alone, "a witness decoded differently in the churn"
    finally:
        llm.engine.shutdown()


def churn(engine, rng: random.Random, live: set[str], outputs: dict[str, list[int]]) -> None:
    """``SOAK_STEPS`` steps adding and aborting requests at random, then steps until every request is done."""
    for step in range(SOAK_STEPS):
        if rng.random() < 0.5:
            rid, n = f"r{step}", rng.choice([1, 5, 17, 40, 90, 150])
            params = SamplingParams(temperature=rng.choice([0, 1]), max_tokens=rng.randint(1, 30), seed=step)
            engine.add_request(rid, [rng.randrange(100, 4000) for _ in range(n)], params)
            live.add(rid)
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                outputs[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids


def test_a_qwen3_5_multimodal_checkpoint_serves_its_text_model(tmp_path, tokenizer):
    """A ``qwen3_5`` checkpoint (``model.language_model.*`` beside a vision tower) loads as its text model,
    as HF's ``AutoModelForCausalLM`` loads it, and decodes what HF decodes."""
    import torch
    from models import hf_greedy, tiny_config
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=tiny_config("qwen3_5_text", len(tokenizer)).to_dict(), vision_config=vision)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=256)
    try:
        prompts = [list(range(100, 140)), list(range(300, 317))]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert ours == [list(tokens) for tokens, _ in hf_greedy(tmp_path, prompts, [8, 8])]
    finally:
        llm.engine.shutdown()
