"""``scheduling_policy="priority"`` end to end: requests start in (priority, arrival) order, and a
priority is refused where the engine cannot honour it (as vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from cb_serve import LLM, AsyncLLM, EngineConfig, InvalidRequestError, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def priority_llm(random_model_dir):
    """One running slot: requests run one at a time, in the scheduler's order."""
    return LLM(
        str(random_model_dir("llama")),
        max_model_len=128,
        num_gpu_blocks=32,
        max_num_seqs=1,
        scheduling_policy="priority",
    )


def test_the_most_urgent_request_finishes_first(priority_llm):
    engine = priority_llm.engine
    for i, priority in enumerate([3, 1, -5, 1]):  # submitted together, before any step
        engine.add_request(f"r{i}", f"request {i} says", PARAMS, priority=priority)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["r2", "r1", "r3", "r0"]  # lower first; equal priorities by arrival


def test_generate_takes_one_priority_per_prompt(priority_llm):
    prompts = [f"prompt {i}" for i in range(3)]
    outs = priority_llm.generate(prompts, PARAMS, use_tqdm=False, priority=[2, 0, 1])
    assert [out.prompt for out in outs] == prompts, "outputs stay in input order"
    started = [out.metrics.first_scheduled_time for out in outs]
    assert started[1] < started[2] < started[0]
    with pytest.raises(ValueError, match="3 prompts but 2 priorities"):
        priority_llm.generate(prompts, PARAMS, use_tqdm=False, priority=[0, 1])


@pytest.mark.parametrize("bad", [True, 1.0, "1", 2**63, -(2**63) - 1])
def test_a_priority_must_be_a_64_bit_int(priority_llm, bad):
    with pytest.raises(InvalidRequestError) as e:
        priority_llm.engine.add_request("bad", "hello", PARAMS, priority=bad)
    assert e.value.param == "priority"
    assert not priority_llm.engine.has_unfinished_requests()


def test_fcfs_refuses_a_nonzero_priority(tiny_llm):
    with pytest.raises(InvalidRequestError, match="Got priority 1 but Priority scheduling is not enabled") as e:
        tiny_llm.generate(["a", "b"], PARAMS, use_tqdm=False, priority=[0, 1])
    assert e.value.param == "priority"
    assert not tiny_llm.engine.has_unfinished_requests(), "nothing was queued"
    with pytest.raises(InvalidRequestError, match="Got priority -1"):
        tiny_llm.engine.add_request("x", "a", PARAMS, priority=-1)
    assert len(tiny_llm.generate(["a"], PARAMS, use_tqdm=False, priority=[0])[0].outputs[0].token_ids) == 3


def test_async_generate_checks_the_priority(random_model_dir):
    engine = AsyncLLM(EngineConfig(model=str(random_model_dir("llama")), max_model_len=128, num_gpu_blocks=32))

    async def main():
        with pytest.raises(InvalidRequestError, match="Priority scheduling is not enabled"):
            async for _ in engine.generate("a", PARAMS, "p", priority=2):
                pass
        return [out async for out in engine.generate("a", PARAMS, "q", priority=0)]

    try:
        assert asyncio.run(main())[-1].finished
    finally:
        engine.shutdown()
