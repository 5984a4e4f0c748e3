"""Request isolation inside the engine (reliability issue, item 4), driven by the real
fault-injection hook: a request's own failure fails it alone, a failed step fails only that
step's requests (retryable) and the engine goes on, a fatal fault stops the engine loudly.
KV blocks come back in every case. Plus the stop checker's O(new text) search."""

from __future__ import annotations

import asyncio

import pytest

from cb_serve import LLM, EngineConfig, RequestOutputKind, SamplingParams
from cb_serve.engine.async_llm import AsyncLLM
from cb_serve.errors import (
    EngineDeadError,
    EngineUnavailableError,
    RequestFailedError,
    StepFailedError,
)
from cb_serve.fault_injection import FaultInjector

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
