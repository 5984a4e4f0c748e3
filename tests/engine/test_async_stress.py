"""Random cancels of every kind of call against a live engine (issue 22): generate run to the
end, left after a few outputs, cancelled at a random moment or before its first output;
inspect with tiny timeouts or cancelled; stats and cache digests; request ids drawn from a
small pool so ids are reused while their earlier requests are still being aborted.

With speculative decoding too (drafts accepted and rejected between the aborts), and with stop
strings (the front end ends a stream on one while the engine runs ahead, under async scheduling too).

After every step (a step listener on the engine thread): the KV blocks are exactly those the
live sequences hold, and every request the engine holds has the stream that added it (none
runs on without a consumer). After every call: the engine is alive; every output a stream gets
continues the greedy tokens its own prompt gets alone (ids are reused, so another request's
output would show), and a request run to the end gets all of them.
At the end every KV block is back.

Short by default; longer: ``CB_SERVE_STRESS_SECONDS=300 pytest tests/engine/test_async_stress.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter

import pytest
from test_async_races import settled
from test_spec_decode import FIXED_K, OracleProposer

from cb_serve import LLM, AsyncLLM, EngineConfig, RequestIdInUseError, RequestOutputKind, SamplingParams
from cb_serve.engine import inbox as inbox_module

STRESS_SECONDS = float(os.environ.get("CB_SERVE_STRESS_SECONDS", "8"))
SEED = int(os.environ.get("CB_SERVE_STRESS_SEED", "0"))
WORKERS = 6
MAX_TOKENS = 24
PROMPTS = [[7 + i, 40 + 3 * i] * (4 + i) for i in range(5)]  # some share nothing, some a prefix


def greedy(max_tokens: int, stop: str | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        stop=[stop] if stop else None,
    )


@pytest.mark.parametrize("mode", ["plain", "speculative", "async"])
def test_random_cancels_of_every_call_leave_the_engine_whole(random_model_dir, monkeypatch, mode):
    """With ``speculative``, every sequence drafts its own greedy continuation with one draft wrong
    at a moving position, so accepted runs, rejections and aborts between them all happen. With ``async``,
    steps are launched ahead (async scheduling): cancels land while a step computing them is in flight."""
    speculate = mode == "speculative"
    model = str(random_model_dir("llama"))
    args = dict(max_model_len=256, num_gpu_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)
    offline = LLM(model, **args)
    outs = offline.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    expected = [out.outputs[0].token_ids for out in outs]
    stops = [out.outputs[0].text[-8:-4] for out in outs]  # near the end, so a stream often stops on one
    stopped = offline.generate(PROMPTS, [greedy(MAX_TOKENS, stop) for stop in stops], use_tqdm=False)
    expected_stopped = [out.outputs[0].token_ids for out in stopped]
    del offline
    monkeypatch.setattr(inbox_module, "REQUEST_ID_WAIT_S", 0.2)
    spec = {"speculative_config": FIXED_K} if speculate else {"async_scheduling": mode == "async"}
    llm = AsyncLLM(EngineConfig(model=model, **args, **spec))
    if speculate:
        llm.engine.speculator.proposer = OracleProposer({tuple(p): e for p, e in zip(PROMPTS, expected)})
    violations: list[str] = []

    def check_step(stats, outputs) -> None:  # engine thread, after each step
        engine = llm.engine
        try:
            engine.check_invariants()
            orphans = [r for r in engine.requests if r not in llm._live]
            assert not orphans, f"requests without a stream: {orphans}"
        except AssertionError as e:
            violations.append(f"step {engine.num_steps}: {e!r}")

    llm.add_step_listener(check_step)
    rng = random.Random(SEED)
    counts: Counter[str] = Counter()

    async def generate(
        request_id: str, prompt: int, max_tokens: int, leave_after: int | None, stop: bool = False
    ) -> None:
        tokens: list[int] = []
        stream = llm.generate(PROMPTS[prompt], greedy(max_tokens, stops[prompt] if stop else None), request_id)
        try:
            async for out in stream:
                assert out.request_id == request_id
                tokens += out.outputs[0].token_ids
                if out.outputs[0].finish_reason == "stop":
                    counts["stopped on a string"] += 1  # not EOS: it is ignored
                assert tokens == expected[prompt][: len(tokens)], (request_id, prompt, tokens)  # its own, so far
                if leave_after is not None and len(tokens) >= leave_after:
                    counts["left early"] += 1
                    return
        finally:
            await stream.aclose()
        assert tokens == (expected_stopped if stop else expected)[prompt][:max_tokens], (request_id, prompt, tokens)
        counts["completed with a stop string" if stop else "completed"] += 1

    async def one_call() -> None:
        kind = rng.choice(["complete", "leave", "cancel", "cancel-at-once", "inspect", "stats"])
        request_id = f"id{rng.randrange(8)}"
        call = None
        if kind == "complete":
            max_tokens = rng.randint(1, MAX_TOKENS)
            call = generate(request_id, rng.randrange(len(PROMPTS)), max_tokens, None, stop=rng.random() < 0.5)
        elif kind == "leave":
            call = generate(request_id, rng.randrange(len(PROMPTS)), MAX_TOKENS, rng.randint(1, 4))
        elif kind in ("cancel", "cancel-at-once"):
            call = generate(request_id, rng.randrange(len(PROMPTS)), MAX_TOKENS, None)
        elif kind == "inspect":
            view = rng.choice(["steps", "state", "timeline"])
            kwargs = {"request_id": request_id} if view == "timeline" else {}
            call = llm.inspect(view, timeout_s=rng.choice([0.001, 0.01, 1.0]), **kwargs)
        else:
            llm.get_stats()
            llm.get_cache_digest()
            counts["stats"] += 1
            await asyncio.sleep(0.001)
            return
        task = asyncio.ensure_future(call)
        if kind == "cancel-at-once" or (kind in ("cancel", "inspect") and rng.random() < 0.5):
            await asyncio.sleep(0 if kind == "cancel-at-once" else rng.uniform(0, 0.05))
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            counts[f"{kind} cancelled"] += 1
        except RequestIdInUseError:
            counts["id in use"] += 1
        except TimeoutError:
            counts["inspect timed out"] += 1
        else:
            counts[kind] += 1

    async def worker(deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            await one_call()
            assert llm.is_alive, llm.error
            assert not violations, violations[:3]

    async def main() -> None:
        deadline = asyncio.get_running_loop().time() + STRESS_SECONDS
        await asyncio.gather(*(worker(deadline) for _ in range(WORKERS)))
        await settled(llm)

    try:
        asyncio.run(main())
        assert llm.is_alive and not violations, violations[:3]
        assert llm.get_stats().kv_blocks_used == 0
        assert counts["completed"] and counts["left early"] and counts["cancel cancelled"], counts
        assert counts["completed with a stop string"] and counts["stopped on a string"], counts
        if speculate:
            spec_counters = llm.engine.speculator.counters
            assert 0 < spec_counters.num_accepted_tokens < spec_counters.num_draft_tokens, spec_counters
    finally:
        llm.shutdown()
    print(dict(counts))
