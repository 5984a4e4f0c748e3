"""The decode steps' DRAM bandwidth bound (``cb_serve.benchmarks.bandwidth``): bytes per step from the
model's layers and the KV cache, the join of step stats with the inspector's records, the fractions."""

from __future__ import annotations

import pytest
import torch
from models import tiny_config
from torch import nn

from cb_serve import SamplingParams, StepStats
from cb_serve.benchmarks.bandwidth import (
    READ_METHODS,
    DecodeStep,
    decode_bound,
    decode_steps,
    kv_bytes_per_token,
    read_bandwidth,
    step_bytes,
    weight_bytes,
)
from cb_serve.model_executor.linear import Linear


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
