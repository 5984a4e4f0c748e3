"""The boundary between asyncio callers and the engine thread under cancellation, id reuse,
engine death and shutdown (issue 22). Each race is driven to its exact interleaving with
events (the engine thread held inside a call, a hook between two caller steps), not sleeps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from cb_serve import (
    LLM,
    AsyncLLM,
    EngineConfig,
    EngineDeadError,
    EngineShutdownError,
    EngineUnavailableError,
    RequestIdInUseError,
    RequestOutputKind,
    SamplingParams,
)
from cb_serve.engine import inbox as inbox_module

WAIT_S = 10.0  # bound on every wait below: a hang fails the test instead of stalling CI
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


class LoopKiller(BaseException):
    """Escapes the inbox drain's per-item isolation (which catches ``Exception``), as a
    ``KeyboardInterrupt`` or a ``SystemExit`` in the engine thread would."""


def die() -> None:
    raise LoopKiller


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


@pytest.fixture()
def llm(random_model_dir) -> Iterator[AsyncLLM]:
    config = EngineConfig(model=str(random_model_dir("llama")), max_model_len=512, num_gpu_blocks=64)
    engine = AsyncLLM(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(random_model_dir) -> Callable[[int], list[int]]:
    """The greedy tokens of ``PROMPT`` alone, offline."""
    offline = LLM(str(random_model_dir("llama")), max_model_len=512, num_gpu_blocks=64)
    cache: dict[int, list[int]] = {}

    def tokens(max_tokens: int) -> list[int]:
        if max_tokens not in cache:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            cache[max_tokens] = offline.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        return cache[max_tokens]

    return tokens


@contextmanager
def engine_held(llm: AsyncLLM, on_release: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Holds the engine thread inside a call (between two steps) for the block; on release the
    call runs ``on_release`` (raising ``LoopKiller`` there kills the loop)."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(WAIT_S)
        on_release()

    llm._send(("call", concurrent.futures.Future(), hold))
    assert entered.wait(WAIT_S), "the engine thread did not take the call"
    try:
        yield
    finally:
        release.set()


async def tokens_of(llm: AsyncLLM, request_id: str, max_tokens: int, prompt=PROMPT) -> list[int]:
    ids: list[int] = []
    async for out in llm.generate(prompt, greedy(max_tokens), request_id):
        assert out.request_id == request_id
        ids += out.outputs[0].token_ids
    return ids


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def settled(llm: AsyncLLM) -> None:
    """Nothing held: no stream, no engine request, no KV block."""
    await until(
        lambda: not llm.inbox.streams and not llm.engine.requests and llm.get_stats().kv_blocks_used == 0,
        "the engine to hold nothing",
    )


def assert_serves(llm: AsyncLLM, reference) -> None:
    assert llm.is_alive
    assert asyncio.run(tokens_of(llm, "after", 5)) == reference(5)


# ---- inspect cancelled at each point of its life -------------------------------------
@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("point", ["queued", "running", "settled", "timed-out"])
def test_a_cancelled_inspect_never_hurts_the_engine(llm, reference, monkeypatch, point, raises):
    """Cancelled while queued behind another call, while the engine thread runs it, after the
    engine settled it but before its caller resumed, or by its own timeout: the engine thread
    skips or settles it quietly and goes on (it used to die on ``InvalidStateError``)."""
    entered, release = threading.Event(), threading.Event()

    def view(what: str, **kwargs):
        entered.set()
        release.wait(WAIT_S)
        if raises:
            raise ValueError("the view failed")
        return {"view": what}

    monkeypatch.setattr(llm.engine, "inspect", view)

    async def main() -> None:
        if point == "queued":
            with engine_held(llm):
                task = asyncio.create_task(llm.inspect("state"))
                await until(lambda: llm.inbox.qsize() == 1, "the call to be queued")
                task.cancel()
                await asyncio.wait([task])  # its future is cancelled before the engine takes the call
                release.set()
        elif point == "running":
            task = asyncio.create_task(llm.inspect("state"))
            await asyncio.to_thread(entered.wait, WAIT_S)
            task.cancel()
            await asyncio.wait([task])  # its future is cancelled while the engine thread runs the call
            release.set()
        elif point == "settled":
            release.set()
            task = asyncio.create_task(llm.inspect("state"))
            await asyncio.sleep(0)  # the call is sent
            # Block this event loop until the engine thread has settled the call (it takes the
            # call queued after it only then), so the task is cancelled with its result in.
            after = threading.Event()
            llm._send(("call", concurrent.futures.Future(), after.set))
            assert after.wait(WAIT_S)
            task.cancel()
        else:
            with pytest.raises(TimeoutError):
                await llm.inspect("state", timeout_s=0.05)
            release.set()
            return
        with pytest.raises(asyncio.CancelledError):  # even when its answer came in the same turn
            await task

    asyncio.run(main())
    release.set()
    assert_serves(llm, reference)
    monkeypatch.undo()
    assert asyncio.run(llm.inspect("steps")) is not None


# ---- one request id, two requests --------------------------------------------------------
@pytest.mark.parametrize("abort_landed", [False, True], ids=["before-abort-lands", "after-abort-lands"])
def test_a_retry_with_the_same_id_gets_exactly_its_own_tokens(llm, reference, abort_landed):
    """A client reads a few tokens, gives up and retries at once under the same id. Before its
    abort lands the retry waits for it (the engine still runs the first request); after, it
    starts at once. Either way it gets exactly its own tokens, and the first request's late
    outputs reach nobody."""

    async def main() -> list[int]:
        first = llm.generate(PROMPT, greedy(200), "dup")
        for _ in range(3):
            await first.__anext__()
        with engine_held(llm):  # the first request is mid-generation; its abort queues up
            await first.aclose()
            if not abort_landed:
                retry = asyncio.create_task(tokens_of(llm, "dup", 20))
                await until(lambda: llm.inbox.streams["dup"].waiters, "the retry to wait for the id")
        if abort_landed:
            await until(lambda: "dup" not in llm.inbox.streams, "the abort to land")
            retry = asyncio.create_task(tokens_of(llm, "dup", 20))
        tokens = await asyncio.wait_for(retry, WAIT_S)
        await settled(llm)
        return tokens

    assert asyncio.run(main()) == reference(20)


def test_a_retry_cancelled_while_it_waits_for_the_id_takes_nothing(llm, reference):
    """Cancelled while it waits for the earlier request with its id, once before and once in the
    turn of the event loop in which the id is released: it raises, and holds nothing."""

    async def main() -> None:
        for same_turn in (False, True):
            first = llm.generate(PROMPT, greedy(200), "dup")
            await first.__anext__()
            released = threading.Event()
            with engine_held(llm):
                await first.aclose()  # its abort queues up behind the held call
                llm._send(("call", concurrent.futures.Future(), released.set))  # runs after the abort
                retry = asyncio.create_task(tokens_of(llm, "dup", 5))
                await until(lambda: llm.inbox.streams["dup"].waiters, "the retry to wait for the id")
                if not same_turn:
                    retry.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await retry
                    assert not llm.inbox.streams["dup"].waiters
            if same_turn:
                assert released.wait(WAIT_S)  # this loop blocked: the release and the cancel meet
                retry.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await retry
            await settled(llm)

    asyncio.run(main())
    assert_serves(llm, reference)


def test_a_wait_cancelled_as_its_future_completes_still_raises():
    """``wait_or_timeout`` (under ``Inbox.add`` and ``inspect``): Python 3.11's
    ``asyncio.wait_for`` returns the result here and swallows the cancellation, so a cancelled
    retry would have gone on to run with nobody reading it."""

    async def main() -> None:
        future = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(inbox_module.wait_or_timeout(future, WAIT_S))
        await asyncio.sleep(0)
        future.set_result(None)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_close_streams_refuses_a_retry_waiting_for_its_id(llm):
    async def main() -> None:
        first = llm.generate(PROMPT, greedy(200), "dup")
        await first.__anext__()
        with engine_held(llm):
            retry = asyncio.create_task(tokens_of(llm, "dup", 5))
            await until(lambda: llm.inbox.streams["dup"].waiters, "the retry to wait for the id")
            llm.close_streams(EngineShutdownError("The server is shutting down; retry the request."))
            with pytest.raises(EngineShutdownError):
                for _ in range(200):  # the outputs it already had come first
                    await first.__anext__()
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            await asyncio.wait_for(retry, WAIT_S)
        await settled(llm)

    asyncio.run(main())


def test_a_stream_abandoned_without_aclose_is_aborted_when_collected(llm):
    """A consumer that drops the generator mid-stream (no ``aclose``, no ``break`` out of an
    ``async for``): asyncio's async-generator finalizer runs its ``finally``, which aborts."""

    async def main() -> None:
        stream = llm.generate(PROMPT, greedy(400), "dropped")
        await stream.__anext__()
        del stream
        gc.collect()
        await settled(llm)

    asyncio.run(main())


def test_an_id_in_flight_is_refused_after_the_wait_and_the_first_request_goes_on(llm, reference, monkeypatch):
    monkeypatch.setattr(inbox_module, "REQUEST_ID_WAIT_S", 0.1)

    async def main() -> list[int]:
        first = asyncio.create_task(tokens_of(llm, "taken", 30))
        await until(lambda: "taken" in llm._live, "the first request to run")
        with engine_held(llm), pytest.raises(RequestIdInUseError, match="in use") as refused:
            await tokens_of(llm, "taken", 5)
        assert refused.value.param == "x-request-id"
        tokens = await first
        await settled(llm)
        return tokens

    assert asyncio.run(main()) == reference(30)


def test_a_request_id_like_another_requests_child_is_its_own_sequence(random_model_dir):
    """Child sequences of ``n > 1`` used to be named ``{id}#{i}``: a request called ``a#1``
    shared a sequence id (and its prefix-cache bookkeeping) with ``a``'s second child."""
    offline = LLM(str(random_model_dir("llama")), max_model_len=512, num_gpu_blocks=64)
    engine = offline.engine
    engine.add_request("a", PROMPT, SamplingParams(n=2, temperature=0, max_tokens=4))
    engine.add_request("a#1", PROMPT, SamplingParams(temperature=0, max_tokens=4))
    seq_ids = [seq.seq_id for state in engine.requests.values() for seq in state.seqs]
    assert len(set(seq_ids)) == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().kv_blocks_used == 0


def test_prompt_tokens_are_counted_once_per_request_whatever_n(random_model_dir):
    offline = LLM(str(random_model_dir("llama")), max_model_len=512, num_gpu_blocks=64)
    offline.generate([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=3), use_tqdm=False)
    stats = offline.engine.get_stats()
    assert stats.prompt_tokens == len(PROMPT) and stats.generation_tokens == 9


# ---- engine death and shutdown ----------------------------------------------------------
def test_generate_and_inspect_queued_when_the_loop_dies_fail_at_once(llm):
    """The loop dies with a request running, a request and a call still in its inbox: each gets
    its error at once (the running one ``EngineDeadError``; what the engine never took
    ``EngineUnavailableError``, safe to retry elsewhere), and later calls fail as they are made."""

    async def main() -> None:
        running = asyncio.create_task(tokens_of(llm, "running", 400))
        await until(lambda: "running" in llm._live, "the request to run")
        with engine_held(llm, on_release=die):
            queued = asyncio.create_task(tokens_of(llm, "queued", 5))
            call = asyncio.create_task(llm.inspect("steps", timeout_s=WAIT_S))
            await until(lambda: llm.inbox.qsize() == 2, "the request and the call to queue")
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(running, WAIT_S)
        for task in (queued, call):
            with pytest.raises(EngineUnavailableError):
                await asyncio.wait_for(task, WAIT_S)
        with pytest.raises(EngineUnavailableError):
            await tokens_of(llm, "later", 5)
        with pytest.raises(EngineUnavailableError):
            await asyncio.wait_for(llm.inspect("steps"), 1.0)  # at once, not after its timeout

    asyncio.run(main())
    assert not llm.is_alive and isinstance(llm.error, LoopKiller)
    assert not llm.inbox.streams and llm.engine.get_stats().kv_blocks_used == 0


@pytest.mark.parametrize("ending", ["death", "shutdown"])
def test_generate_racing_the_end_of_the_loop_never_waits_forever(llm, monkeypatch, ending):
    """The loop ends (it dies, or the server shuts down) just after ``generate`` found it
    running and before it registered its stream: the registration sees it and refuses."""
    process = llm.processor.process

    def end_then_process(*args):
        if ending == "death":
            with engine_held(llm, on_release=die):
                pass
            llm._thread.join(WAIT_S)
        else:
            llm.close_streams(EngineShutdownError("The server is shutting down; retry the request."))
        return process(*args)

    monkeypatch.setattr(llm.processor, "process", end_then_process)

    async def main() -> None:
        with pytest.raises(EngineUnavailableError, match="not running" if ending == "death" else "shutting down"):
            await asyncio.wait_for(tokens_of(llm, "racer", 5), WAIT_S)

    asyncio.run(main())
    assert not llm.inbox.streams


def test_shutdown_with_requests_in_the_inbox_ends_every_stream(llm):
    """Shutdown while the engine thread is busy: the open stream and the queued request get
    their own ``EngineShutdownError`` (one instance each: each caller raises and annotates its
    own), and the loop's end frees what the engine held."""

    async def main() -> list[BaseException]:
        running = asyncio.create_task(tokens_of(llm, "running", 400))
        await until(lambda: "running" in llm._live, "the request to run")
        with engine_held(llm):
            queued = asyncio.create_task(tokens_of(llm, "queued", 5))
            await until(lambda: llm.inbox.qsize() == 1, "the request to queue")
            stopping = asyncio.create_task(asyncio.to_thread(llm.shutdown))
            errors = []
            for task in (running, queued):
                with pytest.raises(EngineShutdownError) as e:
                    await asyncio.wait_for(task, WAIT_S)
                errors.append(e.value)
        await asyncio.wait_for(stopping, WAIT_S)
        return errors

    first, second = asyncio.run(main())
    assert first is not second
    assert not llm.is_alive and not llm.inbox.streams and llm.engine.get_stats().kv_blocks_used == 0


# ---- metrics state of requests that fail after their first token -------------------------
def test_metrics_forget_requests_that_fail_after_their_first_token(random_model_dir):
    """A request whose step fails (step 3) after its first token sends no finished output to the
    step listeners: the engine names it in a later step's ``ended_request_ids``."""
    from test_metrics import FAKE_API

    from cb_serve.serve.metrics import EngineMetrics

    model = str(random_model_dir("llama"))
    config = EngineConfig(model=model, max_model_len=256, num_gpu_blocks=64, fault_injection="step:#3")
    engine = AsyncLLM(config)
    metrics = EngineMetrics(engine, "tiny", interval_s=3600, api=FAKE_API)

    async def main() -> BaseException | None:
        try:
            await tokens_of(engine, "fails", 20)
        except Exception as e:  # noqa: BLE001
            return e
        return None

    try:
        error = asyncio.run(main())
        assert type(error).__name__ == "StepFailedError"
        asyncio.run(tokens_of(engine, "next", 3))  # a later step carries the ended id to the observers
    finally:
        engine.shutdown()
    metrics.close()
    assert metrics._last_token == {}
