"""AsyncLLM: many concurrent streams, abort on early exit, errors surface to callers."""

from __future__ import annotations

import asyncio

import pytest
from observe import recorded_steps

from cb_serve import AsyncLLM, EngineConfig, EngineOverloadedError, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def async_llm(random_model_dir):
    engine = AsyncLLM(
        EngineConfig(
            model=str(random_model_dir("llama")), max_model_len=512, num_gpu_blocks=128, max_num_batched_tokens=256
        )
    )
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, prompt, params, request_id):
    text, ids, finish = "", [], None
    async for out in engine.generate(prompt, params, request_id):
        c = out.outputs[0] if out.outputs else None
        if c is not None:
            text, ids, finish = text + c.text, ids + c.token_ids, c.finish_reason
    return text, ids, finish


async def settled_stats(engine: AsyncLLM, timeout_s: float = 4.0):
    """Engine stats once nothing runs and no KV block is in use (or after ``timeout_s``)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        stats = engine.get_stats()
        if stats.num_running == 0 and stats.kv_blocks_used == 0:
            break
        await asyncio.sleep(0.02)
    return engine.get_stats()


def test_concurrent_streams_match_offline(async_llm, tiny_llm):
    prompts = [f"request number {i} says" for i in range(12)]
    lengths = [5 + 3 * i for i in range(12)]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        for n in lengths
    ]

    async def main():
        return await asyncio.gather(
            *(collect(async_llm, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params)))
        )

    with recorded_steps(async_llm) as steps:
        results = asyncio.run(main())
    offline = tiny_llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False
    )
    for (text, ids, finish), off, n in zip(results, offline, lengths):
        assert ids == off.outputs[0].token_ids and len(ids) == n
        assert text == off.outputs[0].text and finish == "length"
    assert max(s.num_seqs for s in steps) > 1, "requests were not batched together"


def test_leaving_early_aborts_and_frees_blocks(async_llm):
    async def main():
        params = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        seen = 0
        async for _ in async_llm.generate("x " * 50, params, "early"):
            seen += 1
            if seen == 3:
                break
        return await settled_stats(async_llm)

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_cancelled_task_aborts(async_llm):
    async def main():
        params = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        task = asyncio.create_task(collect(async_llm, "y " * 50, params, "cancel-me"))
        while async_llm.get_stats().num_running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await settled_stats(async_llm)

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_bad_input_raises_in_caller(async_llm):
    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in async_llm.generate("", SamplingParams(), "bad"):
                pass

    asyncio.run(main())
    async_llm.check_health()


def test_waiting_queue_limit_admits_exactly_running_slots_plus_waiting(random_model_dir):
    """A burst of 6 at once against 1 running slot + 2 waiting: exactly the first 3 are admitted
    (counted as they arrive, not from the engine's lagging stats), the rest refused at once."""
    engine = AsyncLLM(
        EngineConfig(
            model=str(random_model_dir("llama")),
            max_model_len=512,
            num_gpu_blocks=64,
            max_num_seqs=1,
            max_waiting_requests=2,
        )
    )
    params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(i: int):
        try:
            return await collect(engine, "z", params, f"q{i}")
        except EngineOverloadedError:
            return None

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)))

    try:
        results = asyncio.run(main())
        assert [r is not None for r in results] == [True] * 3 + [False] * 3
        assert all(len(ids) == 200 for _, ids, _ in results[:3])
    finally:
        engine.shutdown()
