"""The decode steps' DRAM bandwidth bound (``cb_serve.benchmarks.bandwidth``): bytes per step from the
model's layers and the KV cache, the join of step stats with the inspector's records, the fractions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import tiny_config
from torch import nn

from cb_serve import LLM, SamplingParams, StepStats
from cb_serve.benchmarks.bandwidth import (
    READ_METHODS,
    DecodeStep,
    decode_bound,
    decode_steps,
    expert_bytes,
    experts_hit,
    kv_bytes_per_token,
    read_bandwidth,
    step_bytes,
    weight_bytes,
)
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.moe import FusedMoE, MoESpec
from cb_serve.model_executor.layers.moe_router import RouterSpec
from cb_serve.stats import ExpertLoad


class RowsSeen(Linear):
    """A ``Linear`` that remembers the rows it was asked about."""

    rows: int | None = None

    def bytes_read(self, rows: int) -> int:
        self.rows = rows
        return super().bytes_read(rows)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 8)
        self.proj = RowsSeen(8, 16, bias=True)
        self.norm = nn.LayerNorm(8, bias=False)  # a parameter outside the Linears: read whole
        self.lm_head = RowsSeen(8, 100, bias=False)


def test_weight_bytes_counts_linears_embedding_rows_and_norms():
    model = TinyLM()
    got = weight_bytes(model, num_tokens=5, num_logit_rows=3)
    assert (model.proj.rows, model.lm_head.rows) == (5, 3)  # the LM head sees the rows that need logits
    linears = (8 * 16 + 16) * 4 + 8 * 100 * 4
    assert got == linears + 5 * 8 * 4 + 8 * 4  # + 5 embedding rows + the norm's weight


def test_step_bytes_adds_every_sequence_context():
    model = TinyLM()
    step = DecodeStep(0.01, 3, 3, (10, 20, 30))
    weights, kv = step_bytes(model, step, kv_per_token=64)
    assert weights == weight_bytes(model, 3, 3) and kv == 64 * 60


def test_kv_bytes_per_token_follows_the_config_and_dtype():
    config = tiny_config("llama", 100)  # 2 layers, 2 KV heads of 64 / 4 = 16 dims
    assert kv_bytes_per_token(config, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 2 * 16 * 2


def stats(prefill: int, seqs: int, duration: float = 0.01) -> StepStats:
    return StepStats(seqs, seqs, prefill, prefill + seqs, 256, 0, duration)


def record(step: int, *computed_after: int) -> dict:
    return {"step": step, "seqs": [{"computed_after": c} for c in computed_after]}


def test_decode_steps_keeps_decode_only_steps_with_matching_records():
    steps = [stats(40, 1), stats(0, 2, 0.02), stats(0, 2), stats(0, 2), stats(0, 1, 0.03)]
    records = [record(10, 40), record(11, 41, 7), record(12, 42), record(14, 43)]  # 12: a sequence short; 13: none
    got = decode_steps(steps, records, first_step_id=10)
    assert got == [DecodeStep(0.02, 2, 2, (41, 7)), DecodeStep(0.03, 1, 1, (43,))]  # no phases: execute 0


def test_decode_bound_fractions_and_median_step():
    model = TinyLM()
    per_step = weight_bytes(model, 1, 1) + 100  # one sequence of 100 KV bytes (1 byte per token)
    # Read at 1 GB/s, step times making the fractions 0.1, 0.2, ..., 0.9.
    steps = [DecodeStep(per_step / 1e9 / f, 1, 1, (100,)) for f in (0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6)]
    bound = decode_bound(model, 1, steps, read_gb_s=1.0)
    assert bound["decode_steps"] == 9
    assert bound["fraction_median"] == pytest.approx(0.5)
    assert bound["fraction_p10"] == pytest.approx(0.18) and bound["fraction_p90"] == pytest.approx(0.82)
    m = bound["median_step"]
    assert m["fraction"] == pytest.approx(0.5) and m["kv_mb"] == pytest.approx(100 / 1e6)
    assert m["weights_mb"] == pytest.approx((per_step - 100) / 1e6) and m["num_seqs"] == 1
    assert bound["execute_fraction_median"] is None  # the steps carry no execute phase
    assert decode_bound(model, 1, [], 1.0) is None
    halves = [DecodeStep(s.duration_s, 1, 1, (100,), s.duration_s / 2) for s in steps]
    assert decode_bound(model, 1, halves, 1.0)["execute_fraction_median"] == pytest.approx(1.0)


def test_read_bandwidth_names_its_best_method():
    got = read_bandwidth(num_bytes=1 << 20, reps=1)
    assert got["method"] in READ_METHODS and got["gb_s"] == max(got["per_method_gb_s"].values()) > 0


def test_decode_steps_from_a_real_engine_run(tiny_llm):
    """Through the engine's public views: the step listener and the inspector's step records give each
    decode step's contexts, which grow by one per step."""
    engine = tiny_llm.engine
    seen: list[StepStats] = []

    def listener(s: StepStats, _outputs: object) -> None:
        seen.append(s)

    first = engine.num_steps + 1
    engine.add_step_listener(listener)
    try:
        prompts = [[5, 6, 7, 8], [9, 10]]
        tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        engine.remove_step_listener(listener)
    records = engine.inspect("steps", after_step=first - 1, limit=len(seen))
    got = decode_steps(seen, records, first)
    assert [sorted(s.context_lens) for s in got] == [[3, 5], [4, 6], [5, 7]]  # prompt + outputs so far
    assert all(s.num_tokens == s.num_logit_rows == 2 and 0 < s.execute_s < s.duration_s for s in got)


# ---- mixtures of experts ---------------------------------------------------------------------------------------
def fused_moe(hidden: int = 8, experts: int = 4, width: int = 6) -> FusedMoE:
    shard = TensorParallelShard(0, 1, range(2), range(1), range(width), range(100))
    spec = MoESpec(RouterSpec(experts, 2), width)
    return FusedMoE(hidden, spec, shard, TensorParallelGroup.single(), use_cpu_ops=False)


class TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 8)
        self.layers = nn.ModuleList([fused_moe(), fused_moe()])
        self.lm_head = RowsSeen(8, 100, bias=False)


EXPERTS_BYTES = (4 * 12 * 8 + 4 * 8 * 6) * 4  # w13 [4, 2 * 6, 8] and w2 [4, 8, 6], float32
ROUTER_BYTES = 8 * 4 * 4  # nn.Linear(8, 4, bias=False), read whole


def test_expert_bytes_counts_the_experts_hit():
    moe = fused_moe()
    assert expert_bytes(moe, None) == EXPERTS_BYTES
    assert expert_bytes(moe, 1) == EXPERTS_BYTES // 4 and expert_bytes(moe, 4) == EXPERTS_BYTES
    assert expert_bytes(moe, 9) == EXPERTS_BYTES  # never more than the experts it holds


def test_weight_bytes_reads_each_layers_hit_experts_and_the_routers():
    model = TinyMoE()
    base = 8 * 100 * 4 + 2 * 8 * 4 + 2 * ROUTER_BYTES  # LM head, 2 embedding rows, both routers whole
    assert weight_bytes(model, 2, 2) == base + 2 * EXPERTS_BYTES  # no routing known: every expert
    assert weight_bytes(model, 2, 2, (1, 3)) == base + EXPERTS_BYTES // 4 + 3 * EXPERTS_BYTES // 4
    step = DecodeStep(0.01, 2, 2, (10, 20), experts_hit=(2, 2))
    assert step_bytes(model, step, kv_per_token=8) == (base + EXPERTS_BYTES, 8 * 30)


def test_experts_hit_from_the_steps_expert_load():
    counts = np.array([[0, 3, 1, 0], [4, 0, 0, 0]])
    assert experts_hit(ExpertLoad((0, 2), counts)) == (2, 1)
    assert experts_hit(None) == ()
    moe_step = StepStats(2, 2, 0, 2, 256, 0, 0.01, expert_load=ExpertLoad((0, 2), counts))
    got = decode_steps([moe_step], [record(5, 40, 7)], first_step_id=5)
    assert got == [DecodeStep(0.01, 2, 2, (40, 7), experts_hit=(2, 1))]


def test_decode_bound_of_a_moe_reports_active_against_all_expert_bytes():
    model = TinyMoE()
    steps = [DecodeStep(0.01, 2, 2, (10,), experts_hit=hit) for hit in ((1, 1), (2, 2), (4, 4))]
    moe = decode_bound(model, 1, steps, read_gb_s=1.0)["moe"]
    assert moe["num_experts"] == 4 and moe["mean_experts_hit_per_layer"] == pytest.approx(7 / 3)
    assert moe["median_step_experts_hit_per_layer"] == 2.0
    assert moe["median_step_active_weights_mb"] == pytest.approx(weight_bytes(model, 2, 2, (2, 2)) / 1e6)
    assert moe["median_step_all_experts_weights_mb"] == pytest.approx(weight_bytes(model, 2, 2) / 1e6)
    assert "moe" not in decode_bound(TinyLM(), 1, [DecodeStep(0.01, 1, 1, (10,))], 1.0)


def test_moe_decode_steps_from_a_real_engine_run(random_model_dir):
    """A Qwen3-MoE engine (sparse layers 0 and 2 of 3, top 2 of 8): every decode step records the
    experts its two sequences hit in each sparse layer, and its bytes count only those."""
    llm = LLM(str(random_model_dir("qwen3_moe")), max_model_len=256, num_gpu_blocks=64)
    seen: list[StepStats] = []
    llm.engine.add_step_listener(lambda s, _outputs: seen.append(s))
    first = llm.engine.num_steps + 1
    llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    records = llm.engine.inspect("steps", after_step=first - 1, limit=len(seen))
    got = decode_steps(seen, records, first)
    assert got and all(len(s.experts_hit) == 2 and all(2 <= n <= 4 for n in s.experts_hit) for s in got)
    model = llm.engine.runner.model
    assert weight_bytes(model, 2, 2, got[0].experts_hit) < weight_bytes(model, 2, 2)
