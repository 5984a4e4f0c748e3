"""Structured outputs in the engine's step stats, metrics and inspector (issue 23): the grammar
work of each step (constrained rows, bitmask fill and wait), compile durations handed over once,
constrained requests counted, requests waiting for their grammar counted as waiting, what
``EngineMetrics`` records of it all, and the inspector's marks."""

from __future__ import annotations

import time

import pytest
from observe import recorded_steps

from cb_serve import EngineConfig, InvalidRequestError, SamplingParams, StepStats, StructuredOutputsParams
from cb_serve.engine.llm_engine import LLMEngine
from cb_serve.structured_outputs.base import CompiledGrammar, GrammarBackend
from cb_serve.structured_outputs.compiler import GrammarCompiler

pytest.importorskip("llguidance")

REGEX = r"[a-z]{3,6}-\d{2}"


@pytest.fixture(scope="module")
def engine(random_model_dir) -> LLMEngine:
    """Its own engine: a fresh grammar cache, and the inspector on. Each test uses its own constraints."""
    config = EngineConfig.from_kwargs(
        model=str(random_model_dir("llama")), max_model_len=256, num_gpu_blocks=64, inspector_steps=1000
    )
    return LLMEngine(config)


def constrained(constraint: StructuredOutputsParams, n: int = 1, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, structured_outputs=constraint)


def plain(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> list[StepStats]:
    """Adds ``requests`` and steps until every one finished: the ``StepStats`` of those steps."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    with recorded_steps(engine) as steps:
        while engine.has_unfinished_requests():
            engine.step()
    return steps


def test_step_stats_carry_each_steps_grammar_work(engine):
    before = engine.get_stats().num_constrained_requests
    steps = run(engine, {"c": ([1, 5, 9, 23], constrained(StructuredOutputsParams(regex=REGEX), n=2)),
                         "p": ([3, 3, 3, 8], plain())})  # fmt: skip
    with_grammar = [s for s in steps if s.num_constrained_seqs]
    assert with_grammar and len(with_grammar) < len(steps)  # the plain request decodes on after the grammar ends
    assert max(s.num_constrained_seqs for s in steps) == 2  # both sequences of n=2
    assert all(s.grammar_fill_s > 0 and s.grammar_wait_s >= 0 for s in with_grammar)
    assert all(s.grammar_fill_s == s.grammar_wait_s == 0 for s in steps if not s.num_constrained_seqs)
    compiles = [t for s in steps for t in s.grammar_compile_s]
    assert len(compiles) == 1 and compiles[0] > 0  # one grammar, compiled once, reported once
    assert sum(s.num_constrained_requests for s in steps) == 1
    assert engine.get_stats().num_constrained_requests == before + 1

    again = run(engine, {"c2": ([2, 4, 6], constrained(StructuredOutputsParams(regex=REGEX)))})
    assert not [t for s in again for t in s.grammar_compile_s]  # a cache hit compiles nothing
    assert sum(s.num_constrained_requests for s in again) == 1 and any(s.num_constrained_seqs for s in again)


def test_requests_waiting_for_their_grammar_count_as_waiting(engine):
    engine.add_request("w", [7, 8, 9], constrained(StructuredOutputsParams(choice=["left", "right"]), n=3))
    stats = engine.get_stats()  # before any step: the grammar is never admitted outside one
    assert (stats.num_requests_waiting_grammar, stats.num_requests_waiting, stats.num_waiting) == (1, 1, 3)
    assert stats.num_waiting_tokens == 3 * 3
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert (stats.num_requests_waiting_grammar, stats.num_requests_waiting, stats.num_waiting) == (0, 0, 0)


class _Fake:
    """A Ray metric stand-in keeping every value recorded; ``inc`` refuses what Ray refuses."""

    def __init__(self, name: str, description: str = "", boundaries=None, tag_keys: tuple = ()) -> None:
        self.values: list[float] = []

    def set_default_tags(self, tags: dict[str, str]) -> None:
        pass

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        assert value > 0, "Ray's counters take only positive increments"
        self.values.append(value)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values.append(value)

    set = observe


FAKE_API = type("FakeMetrics", (), {"Counter": _Fake, "Gauge": _Fake, "Histogram": _Fake})


def test_engine_metrics_record_the_grammar_work(engine):
    from cb_serve.serve.metrics import EngineMetrics

    metrics = EngineMetrics(engine, "tiny", interval_s=3600, api=FAKE_API)  # flushed by hand
    m = metrics.m
    try:
        metrics.flush()  # the counters catch up with the (shared) engine's earlier requests
        counted = len(m["structured_output_requests"].values)
        engine.add_request("m", [4, 4, 2], constrained(StructuredOutputsParams(regex=r"\d{4}-[ab]{2}")))
        metrics.flush()
        assert m["num_requests_waiting_grammar"].values[-1] == 1 and m["num_requests_waiting"].values[-1] == 1
        steps = run(engine, {"m-plain": ([5, 6], plain(4))})
    finally:
        metrics.close()
    with_grammar = sum(1 for s in steps if s.num_constrained_seqs)
    assert with_grammar > 0
    assert m["structured_output_requests"].values[counted:] == [1]  # the plain request is not one
    assert len(m["grammar_compile_seconds"].values) == 1 and m["grammar_compile_seconds"].values[0] > 0
    assert len(m["grammar_bitmask_fill_seconds"].values) == with_grammar  # only steps with constrained rows
    assert all(v > 0 for v in m["grammar_bitmask_fill_seconds"].values)
    assert len(m["grammar_bitmask_wait_seconds"].values) == with_grammar
    assert m["jump_forward_tokens"].values == [s.jump_forward_tokens for s in steps if s.jump_forward_tokens]
    assert m["num_requests_waiting_grammar"].values[-1] == 0


def test_the_inspector_marks_constrained_sequences(engine):
    start = engine.num_steps
    steps = run(engine, {"i": ([9, 9, 1], constrained(StructuredOutputsParams(regex=r"[xyz]{4}"))),
                         "i-plain": ([8, 8, 1], plain(8))})  # fmt: skip
    records = [r for r in engine.inspector.steps if r.step_id > start]
    assert len(records) == len(steps)
    for r, s in zip(records, steps):
        marks = {x.request_id: x.constrained for x in r.seqs}
        assert marks.get("i", True) and not marks.get("i-plain", False)
        assert (r.grammar_fill_s, r.grammar_wait_s) == (s.grammar_fill_s, s.grammar_wait_s)
        assert (r.grammar_fill_s > 0) == ("i" in marks)  # short prompts: every step of "i" samples
        view = r.to_dict()
        assert {x["request_id"]: x["constrained"] for x in view["seqs"]} == marks
        assert (view["grammar_fill_s"], view["grammar_wait_s"]) == (r.grammar_fill_s, r.grammar_wait_s)
    assert engine.inspector.timeline("i")["constrained"] and not engine.inspector.timeline("i-plain")["constrained"]
    names = {f"step {r.step_id}" for r in records}
    trace = engine.inspect("trace", since=records[0].start, pid=1, name="x")
    slices = [e["args"] for e in trace if e["ph"] == "X" and e["name"] in names]
    assert len(slices) == len(records) and any(a["constrained"] for a in slices)
    assert all((a["constrained"] > 0) == (a["grammar_fill_s"] > 0) for a in slices)


class _Grammar(CompiledGrammar):
    def matcher(self):
        raise NotImplementedError


class _Backend(GrammarBackend):
    """Compiles any regex but ``bad`` (slowly enough for a clock to see)."""

    name = "fake"

    @property
    def vocab_size(self) -> int:
        return 64

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        time.sleep(0.001)
        if params.regex == "bad":
            raise InvalidRequestError("structured_outputs: bad", "structured_outputs")
        return _Grammar()


def test_the_compiler_reports_each_successful_compile_once():
    compiler = GrammarCompiler(_Backend)
    try:
        assert compiler.drain_compile_times() == ()
        compiler.submit(StructuredOutputsParams(regex="a")).result()
        compiler.submit(StructuredOutputsParams(regex="a")).result()  # cached: no compile
        assert compiler.submit(StructuredOutputsParams(regex="bad")).exception() is not None
        compiler.submit(StructuredOutputsParams(regex="b")).result()
        times = compiler.drain_compile_times()
        assert len(times) == 2 and all(t > 0 for t in times)
        assert compiler.drain_compile_times() == ()
    finally:
        compiler.shutdown()
