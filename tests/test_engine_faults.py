"""Request isolation inside the engine (reliability issue, item 4), driven by the real
fault-injection hook: a request's own failure fails it alone, a failed step fails only that
step's requests (retryable) and the engine goes on, a fatal fault stops the engine loudly.
KV blocks come back in every case. Plus the stop checker's O(new text) search."""

from __future__ import annotations

import asyncio

import pytest

from cb_serve import LLM, EngineConfig, RequestOutputKind, SamplingParams
from cb_serve.engine.async_llm import AsyncLLM
from cb_serve.engine.errors import (
    EngineDeadError,
    EngineUnavailableError,
    RequestFailedError,
    StepFailedError,
)
from cb_serve.engine.fault_injection import FaultInjector
from cb_serve.engine.stop_checker import StopChecker

FAULTS = "request:REQUEST_FAULT,step:STEP_FAULT,fatal:FATAL_FAULT"


def params(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA)


async def run(engine: AsyncLLM, prompt: str, request_id: str, max_tokens: int = 12) -> int | BaseException:
    """Tokens generated, or the exception the stream raised."""
    tokens = 0
    try:
        async for out in engine.generate(prompt, params(max_tokens), request_id):
            tokens += sum(len(c.token_ids) for c in out.outputs)
    except Exception as e:  # noqa: BLE001
        return e
    return tokens


async def settled(engine: AsyncLLM) -> None:
    for _ in range(200):
        s = engine.get_stats()
        if s.num_running == s.num_waiting == s.kv_blocks_used == 0:
            return
        await asyncio.sleep(0.02)


@pytest.fixture()
def engine(random_model_dir):
    e = faulty_engine(random_model_dir, FAULTS)
    yield e
    e.shutdown()


def faulty_engine(random_model_dir, faults: str) -> AsyncLLM:
    model = str(random_model_dir("llama"))
    return AsyncLLM(EngineConfig(model=model, max_model_len=256, num_gpu_blocks=64, fault_injection=faults))


def test_a_request_fault_fails_that_request_alone(engine):
    async def main():
        results = await asyncio.gather(
            run(engine, "healthy one", "a", 30),
            run(engine, "REQUEST_FAULT here", "bad"),
            run(engine, "healthy two", "b", 30),
        )
        await settled(engine)
        return results

    a, bad, b = asyncio.run(main())
    assert (a, b) == (30, 30), "the other requests in the same batch finish normally"
    assert isinstance(bad, RequestFailedError) and "Traceback" not in str(bad)
    s = engine.get_stats()
    assert s.kv_blocks_used == 0 and s.num_failed_requests == 1 and s.num_failed_steps == 0
    assert engine.is_alive


def test_a_step_fault_fails_that_steps_requests_and_the_engine_goes_on(engine):
    async def main():
        first = await asyncio.gather(run(engine, "STEP_FAULT now", "s1"), run(engine, "beside it", "s2"))
        await settled(engine)
        after = await run(engine, "a later request", "s3")
        return first, after

    (faulty, beside), after = asyncio.run(main())
    assert isinstance(faulty, StepFailedError) and faulty.retryable
    assert isinstance(beside, (StepFailedError, int)), "a request outside the failed step is not touched"
    assert after == 12, "requests after the failed step succeed"
    assert engine.get_stats().kv_blocks_used == 0 and engine.is_alive


def test_a_fatal_fault_stops_the_engine_and_tells_every_caller(engine):
    async def main():
        results = await asyncio.gather(run(engine, "healthy", "h", 200), run(engine, "FATAL_FAULT", "f"))
        return results, await run(engine, "after", "x")

    (healthy, fatal), after = asyncio.run(main())
    assert isinstance(fatal, EngineDeadError) and isinstance(healthy, (EngineDeadError, int))
    assert isinstance(after, EngineUnavailableError), "a dead engine refuses new requests at once"
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_three_failed_steps_in_a_row_are_fatal(random_model_dir):
    engine = faulty_engine(random_model_dir, "step:#1,step:#2,step:#3")
    try:

        async def main():
            return [await run(engine, f"try {i}", f"t{i}") for i in range(3)]

        results = asyncio.run(main())
        assert [type(r) for r in results] == [StepFailedError, StepFailedError, EngineDeadError]
        assert not engine.is_alive
    finally:
        engine.shutdown()


def test_offline_generate_reports_a_failed_request(random_model_dir):
    llm = LLM(str(random_model_dir("llama")), max_model_len=256, num_gpu_blocks=64, fault_injection=FAULTS)
    outs = llm.generate(["fine", "REQUEST_FAULT"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 5
    assert isinstance(outs[1].error, RequestFailedError) and outs[1].outputs[0].finish_reason == "error"
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_fault_specs_are_validated():
    for bad in ("", "boom:x", "request:#3", "step:#0", "step"):
        with pytest.raises(ValueError):
            FaultInjector(bad)
    with pytest.raises(ValueError, match="fault_injection"):
        EngineConfig(fault_injection="nope:x")


class _Text:
    """A detokenizer stand-in that appends given text pieces and counts characters searched."""

    def __init__(self) -> None:
        self.text = ""
        self.pieces: list[str] = []

    def append(self, token_id: int) -> int:
        self.text += self.pieces[token_id]
        return len(self.pieces[token_id])

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]


def test_stop_strings_are_found_across_tokens_and_cut_where_they_start():
    checker = StopChecker(SamplingParams(stop=["END", "xyz"], max_tokens=100))
    detok = _Text()
    detok.pieces = ["hello ", "wor", "ld E", "N", "D tail"]
    decisions = [checker.update(i, i + 1, False, detok) for i in range(5)]
    assert decisions[:4] == [None] * 4 and decisions[4] == ("stop", "END")
    assert detok.text == "hello world "
    assert checker.holdback == 2


def test_stop_string_search_looks_only_at_the_new_text(monkeypatch):
    """The per-token search covers the new characters plus the longest stop string - 1,
    whatever the output length: every ``str.find`` starts that close to the end."""
    stops = [f"stop-{i:03d}" for i in range(64)]
    checker = StopChecker(SamplingParams(stop=stops, max_tokens=10_000))
    starts: list[int] = []

    class Spy(str):
        def find(self, sub, start=0, *args):  # noqa: D102
            starts.append(len(self) - start)
            return str.find(self, sub, start, *args)

    detok = _Text()
    detok.pieces = ["word "]
    for _ in range(2000):
        detok.text = Spy(detok.text + "word ")
        assert checker._find_stop_string(detok, 5) is None
    assert max(starts) <= 5 + max(map(len, stops)) - 1
    assert len(starts) == 2000 * 64


def test_min_tokens_bans_stop_tokens_then_lets_them_stop():
    p = SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=10)
    p.eos_token_ids = frozenset({2})
    checker = StopChecker(p)
    assert checker.banned_token_ids(0) == [2, 7] and checker.banned_token_ids(3) == []
    assert checker.update(7, 2, False, None) is None
    assert checker.update(7, 3, False, None) == ("stop", 7)
    assert checker.update(2, 3, False, None) == ("stop", None)
    assert checker.update(5, 10, True, None) == ("length", None)
