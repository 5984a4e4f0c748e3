"""A mixture of experts' load (issue 39): each step's tokens per expert of every MoE layer, read from
the driver's model into ``StepStats.expert_load`` and the inspector's layer x expert heat map. The
counts are the router's choices (HF's, for a prompt in one step), every scheduled token counted
``top_k`` times per MoE layer under chunked prefill and speculative decoding (the drafts the target
verifies, never the draft model's own passes); a dense model records nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from observe import recorded_steps

from cb_serve import EngineConfig, SamplingParams
from cb_serve.engine.expert_heatmap import ExpertHeatmap
from cb_serve.engine.llm_engine import LLMEngine

TOP_K, NUM_EXPERTS = 2, 8  # tests/models.py's qwen3_moe: layers 0 and 2 sparse, layer 1 dense (mlp_only_layers)
WINDOW = 8  # the heat map's steps (the page's 60 in production)


@pytest.fixture(scope="module")
def engine(random_model_dir):
    """A 32-token budget (the prompts are chunked); the model drafts for itself (a draft model: a mixture
    of experts too, with a runner of its own)."""
    model = str(random_model_dir("qwen3_moe"))
    config = EngineConfig.from_kwargs(
        model=model,
        max_model_len=256,
        num_gpu_blocks=64,
        block_size=16,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 2, "adaptive": False},
    )
    return LLMEngine(config)


def run(engine, prompts: dict[str, list[int]], max_tokens: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
    with recorded_steps(engine) as steps:
        while engine.has_unfinished_requests():
            engine.step()
    return steps


def test_each_step_counts_its_tokens_top_k_times_per_moe_layer(engine):
    engine.inspector.experts = ExpertHeatmap(WINDOW)
    prompts = {f"r{i}": [300 + 40 * i + j for j in range(30 + 15 * i)] for i in range(3)}
    steps = run(engine, prompts, max_tokens=16)
    assert len(steps) > WINDOW and max(s.num_prefill_tokens for s in steps) == 32
    assert sum(s.num_draft_tokens for s in steps) > 0
    for s in steps:
        load = s.expert_load
        assert load.layers == (0, 2) and load.counts.shape == (2, NUM_EXPERTS) and load.counts.dtype == np.int64
        assert load.counts.sum(axis=1).tolist() == [TOP_K * s.num_scheduled_tokens] * 2
        assert 1 <= load.imbalance <= NUM_EXPERTS
        busiest, mean = load.counts.max(axis=1).sum(), load.counts.sum() / NUM_EXPERTS
        assert load.imbalance == pytest.approx(busiest / mean)
    # The inspector's heat map: the same counts, summed over the last WINDOW steps.
    heat = engine.inspect("state")["experts"]
    window = steps[-WINDOW:]
    assert heat["layers"] == [0, 2] and heat["num_experts"] == NUM_EXPERTS and heat["steps"] == WINDOW
    assert heat["last_step"] == engine.num_steps and heat["first_step"] == engine.num_steps - WINDOW + 1
    assert heat["tokens"] == np.sum([s.expert_load.counts for s in window], axis=0).tolist()


def test_the_counts_are_the_routers_choices(engine, random_model_dir):
    """A 24-token prompt in one step: per MoE layer, how often each expert is among HF's top-k router logits."""
    from transformers import AutoModelForCausalLM

    ids = [900 + 3 * j for j in range(24)]
    (step, *_) = run(engine, {"hf": ids}, max_tokens=1)
    assert step.num_scheduled_tokens == len(ids)
    hf = AutoModelForCausalLM.from_pretrained(random_model_dir("qwen3_moe"), dtype=torch.float32)
    with torch.no_grad():
        router_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    expected = [
        torch.bincount(r.topk(TOP_K).indices.reshape(-1), minlength=NUM_EXPERTS).tolist() for r in router_logits
    ]
    assert step.expert_load.counts.tolist() == expected


def test_a_dense_model_records_no_expert_load(tiny_llm):
    engine = tiny_llm.engine
    assert engine.runner.moe_layers == []
    with recorded_steps(engine) as steps:
        tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert steps and all(s.expert_load is None for s in steps)
    assert engine.inspect("state")["experts"] is None  # the inspector records (its default), with no heat map


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_steps_count_their_graphs_rows(random_model_dir):
    """On CUDA with graphs: a prefill step counts its tokens; a decode step of 3 sequences replays the graph of
    4 rows, whose padding row the experts run too (``top_k`` x 4 per layer)."""
    from cb_serve import LLM

    llm = LLM(str(random_model_dir("qwen3_moe")), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8)
    assert llm.engine.runner.graph_runner is not None
    with recorded_steps(llm.engine) as steps:
        llm.generate([[5 + i] * 10 for i in range(3)], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    prefill, *decodes = steps
    assert prefill.expert_load.counts.sum(axis=1).tolist() == [TOP_K * 30] * 2
    assert decodes and all(s.expert_load.counts.sum(axis=1).tolist() == [TOP_K * 4] * 2 for s in decodes)
