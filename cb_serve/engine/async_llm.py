"""Asyncio front of the engine: the step loop runs in a background thread; any number of
coroutines call ``generate`` and iterate their outputs.

Every call crosses to the engine thread through the ``Inbox`` (``inbox.py``: a stream per
``generate`` call, request ids held until the engine lets go of them). The engine thread
handles each item on its own, so one that raises fails only itself; it skips a call whose
caller gave up (a cancelled ``inspect``), and no delivery can raise. Once the loop has ended
(it died, or ``shutdown``), nothing waits on it: what is queued and every open stream fail at
once, and an item sent later fails as it is sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from cb_serve.config import EngineConfig
from cb_serve.engine.gc_heap import frozen_heap
from cb_serve.engine.inbox import Inbox, Item, Stream, call_soon, put_all, settle, wait_or_timeout
from cb_serve.engine.llm_engine import LLMEngine, StepListener
from cb_serve.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
    RequestFailedError,
)
from cb_serve.inputs import PromptType
from cb_serve.lora_request import LoRARequest
from cb_serve.model_executor.device_context import bind_thread_to_device, concrete_device
from cb_serve.outputs import RequestOutput
from cb_serve.prefix_hash import PrefixDigest
from cb_serve.sampling_params import SamplingParams
from cb_serve.stats import EngineStats

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Thread-safe, asyncio-friendly engine. ``generate`` validates in the caller (bad input
    raises ``InvalidRequestError``, a ``ValueError``, at once), then streams ``RequestOutput``s;
    leaving the iteration early (client gone, ``CancelledError``) aborts the request and frees
    its KV blocks. A request that fails raises its ``EngineError`` from the iteration; the
    engine goes on unless the error is fatal, after which ``check_health`` raises."""

    def __init__(self, config: EngineConfig) -> None:
        self._engine = LLMEngine(config)
        self.config = config
        self.model_name = self._engine.model_name
        self.max_model_len = self._engine.max_model_len
        self.block_size = self._engine.block_size
        self.worker_pids = self._engine.worker_pids  # tensor-parallel workers' processes
        # The engine thread detokenizes with its own tokenizer; callers tokenize with this copy.
        self.tokenizer = copy.deepcopy(self._engine.tokenizer)
        self.processor = self._engine.processor.with_tokenizer(self.tokenizer)
        # Requests held (running, waiting or not yet taken by the engine thread) fill at most
        # max_num_seqs running slots plus max_waiting_requests; counted on the callers' side,
        # where concurrent arrivals see exact counts (the engine's own numbers lag a step).
        limit = config.max_waiting_requests
        full = f"The engine's waiting queue is full ({limit} requests); retry later."
        self._inbox = Inbox(None if limit is None else config.max_num_seqs + limit, full)
        self._live: dict[str, Stream] = {}  # engine thread: request id -> stream, of the requests the engine holds
        self._stop = False
        self.error: BaseException | None = None
        self._stats = self._engine.get_stats()
        self._digest = self._engine.cache_digest()
        self._digest_wanted = False
        # The engine thread makes the engine's device its current one (Triton kernels launch on the
        # current device): resolved here, in the thread whose current device bare "cuda" meant.
        self._device = concrete_device(self._engine.device)
        self._thread = threading.Thread(target=self._loop, name="cb-serve-engine", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> LLMEngine:
        """The engine this drives: its thread alone may call it while the loop runs (a hook for
        tests and benchmarks, which read its owners, or call it once the loop has ended)."""
        return self._engine

    @property
    def inbox(self) -> Inbox:
        """The queue between the callers and the engine thread, with the open streams (a hook for
        tests that drive a race to its exact interleaving)."""
        return self._inbox

    # ---- caller side ----------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """``lora_request``: the adapter to run with; one the engine does not hold yet is read and
        checked on a worker thread first (a bad one raises ``InvalidRequestError``). ``priority``:
        under ``scheduling_policy="priority"``, lower values are scheduled first."""
        with self._inbox.lock:
            self._inbox.check_open()
        processed = self.processor.process(prompt, params)
        processed.priority = self._engine.checked_priority(priority)
        if lora_request is not None:
            processed.lora_weights = await asyncio.to_thread(self._engine.read_lora, lora_request)
            processed.lora_request = lora_request
        stream = await self._inbox.add(request_id, processed)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send(("abort", stream, None))

    async def add_lora(self, lora_request: LoRARequest, timeout_s: float = 30.0) -> None:
        """Reads and checks an adapter (on a worker thread), then has the engine hold it in host
        memory; raises ``InvalidRequestError`` for one that cannot be served."""
        weights = await asyncio.to_thread(self._engine.read_lora, lora_request)
        await self._call(functools.partial(self._engine.add_lora, lora_request, weights), timeout_s)

    def add_lora_blocking(self, lora_request: LoRARequest, timeout_s: float = 60.0) -> None:
        """``add_lora`` for a caller outside any event loop (a replica's constructor)."""
        weights = self._engine.read_lora(lora_request)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", future, functools.partial(self._engine.add_lora, lora_request, weights)))
        future.result(timeout_s)

    def lora_adapter_ids(self) -> list[int]:
        """``lora_int_id`` of the adapters the engine holds now."""
        return self._engine.lora_adapter_ids()

    def _send(self, item: Item) -> None:
        """Queues ``item`` for the engine thread, or fails it at once if the loop has ended."""
        if not self._inbox.put(item):
            self._inbox.fail(item, self._not_running())

    def get_stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its latest step."""
        return self._stats

    def get_cache_digest(self) -> PrefixDigest | None:
        """What the prefix cache held when the engine thread last refreshed this (None without
        prefix caching). Each call asks for a refresh after the current step, so polling every
        P seconds gives digests at most P seconds plus one step old, and costs nothing unpolled."""
        if not self._digest_wanted:
            self._digest_wanted = True
            self._inbox.wake.set()
        return self._digest

    async def inspect(self, what: str, timeout_s: float = 10.0, **kwargs: Any) -> Any:
        """``LLMEngine.inspect(what, **kwargs)``, taken on the engine thread between two steps.
        Cancelling the caller is safe: the engine thread skips a call nobody waits for."""
        return await self._call(functools.partial(self._engine.inspect, what, **kwargs), timeout_s)

    async def _call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """``fn()`` on the engine thread between two steps; cancelling the caller is safe."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", future, fn))
        answer = asyncio.wrap_future(future)
        if not await wait_or_timeout(answer, timeout_s):  # cancelling `answer` cancels `future`
            raise TimeoutError(f"The engine thread did not answer within {timeout_s} s.")
        return answer.result()

    def add_step_listener(self, listener: StepListener) -> None:
        """``listener(stats, outputs)`` runs on the engine thread after every step (see
        ``LLMEngine.add_step_listener``): queue what you need and return."""
        self._engine.add_step_listener(listener)

    def remove_step_listener(self, listener: StepListener) -> None:
        self._engine.remove_step_listener(listener)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def close_streams(self, error: EngineError) -> None:
        """Refuses new requests (``EngineUnavailableError``) and ends every open stream with a
        copy of ``error`` (its request is aborted). For shutdown: no stream is left hanging."""
        for stream in self._inbox.close(error):
            stream.put(copy.copy(error))  # one instance per caller: each raises (and annotates) its own
            self._send(("abort", stream, None))

    def check_health(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"The engine loop died: {self.error!r}") from self.error
        if not self._thread.is_alive():
            raise EngineDeadError("The engine loop is not running.")
        if dead := self._engine.dead_workers():  # found here even while no step runs
            raise EngineDeadError(f"Tensor-parallel worker rank(s) {dead} died.")

    def shutdown(self) -> None:
        """Ends open streams with ``EngineShutdownError`` and stops the engine thread."""
        self.close_streams(EngineShutdownError("The server is shutting down; retry the request."))
        self._stop = True
        self._inbox.wake.set()
        self._thread.join(timeout=30)
        self._engine.shutdown()

    # ---- engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            bind_thread_to_device(self._device)
            with frozen_heap(collect=True):  # the loop runs as long as the engine: start from a clean heap
                self._steps()
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on; callers are told at once
            logger.exception("engine loop died")
            self.error = e
        finally:
            self._end_loop()

    def _steps(self) -> None:
        engine, wake = self._engine, self._inbox.wake
        while not self._stop:
            wake.clear()
            self._drain_inbox()
            if not engine.has_unfinished_requests():
                self._snapshot()
                wake.wait(timeout=1.0)
                continue
            outputs = engine.step()  # contains every failure it can survive
            self._snapshot()  # before the outputs: a caller sees stats at least as new
            self._deliver(outputs)

    def _snapshot(self) -> None:
        self._stats = self._engine.get_stats()
        if self._digest_wanted:
            self._digest_wanted = False
            self._digest = self._engine.cache_digest()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs to their streams: one wake-up per event loop, not per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput | BaseException]]] = {}
        ended = []
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream.loop, []).append((stream, out.error if out.error is not None else out))
            if out.finished:
                del self._live[out.request_id]
                ended.append(stream)
        for loop, items in by_loop.items():
            call_soon(loop, put_all, items)
        for stream in ended:  # after its last output is on its way, as one delivery at a time did
            self._inbox.release(stream)

    def _drain_inbox(self) -> None:
        while (item := self._inbox.get()) is not None:
            try:
                self._handle(item)
            except Exception as e:  # noqa: BLE001 - one item's failure, never the loop's
                logger.error("engine call %r failed", item[0], exc_info=e)
                if item[0] != "call":
                    self._forget(item[1])
                self._inbox.fail(item, RequestFailedError("This request failed on the server."))

    def _handle(self, item: Item) -> None:
        op, target, payload = item
        if op == "call":
            if target.set_running_or_notify_cancel():  # False: its caller gave up
                try:
                    result = payload()
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    settle(target, error=e)
                else:
                    settle(target, result)
            return
        request_id = target.request_id
        if op == "abort":
            if self._live.get(request_id) is target:  # not an earlier request's late abort
                del self._live[request_id]
                self._engine.abort_request(request_id)
            self._inbox.release(target)
            return
        assert op == "add" and request_id not in self._live, (op, request_id)
        try:
            self._engine.add_processed_request(request_id, payload)
        except (ValueError, EngineOverloadedError) as e:  # the request's own input, or a full queue
            self._inbox.fail(item, e)
            return
        self._live[request_id] = target

    def _forget(self, stream: Stream) -> None:
        """Drops whatever the engine holds of ``stream``'s request (not of another stream's
        request with the same id)."""
        holder = self._live.get(stream.request_id)
        if holder is stream:
            del self._live[stream.request_id]
        if holder in (None, stream):
            try:
                self._engine.abort_request(stream.request_id)
            except Exception:  # noqa: BLE001 - best effort; the stream ends anyway
                logger.exception("aborting request %s failed", stream.request_id)

    def _not_running(self) -> EngineError:
        if self._inbox.closing is not None:
            return EngineShutdownError("The server is shutting down; retry the request.")
        return EngineUnavailableError("The engine is not running; retry the request.")

    def _end_loop(self) -> None:
        """The loop has ended: everything sent to it or waiting on it fails now (what the engine
        never took with ``EngineUnavailableError``, safe to retry elsewhere), and anything sent
        later fails as it is sent."""
        items, held = self._inbox.end()
        try:  # first: a caller told of the end finds the request's KV blocks already free
            self._engine.abort_request(list(self._engine.requests))
        except Exception:  # noqa: BLE001 - best effort: the replica is replaced anyway
            logger.exception("freeing the requests of the stopped engine failed")
        for item in items:
            self._inbox.fail(item, self._not_running())
        for stream in self._live.values():
            dead = self.error is not None
            self._inbox.release(stream)  # first: a caller that sees the error finds its id free
            stream.put(
                EngineDeadError("The engine replica failed; retry the request.") if dead else self._not_running()
            )
        self._live.clear()
        for stream in held:  # none is expected: each was queued (failed above) or taken
            if not stream.ended:
                stream.put(self._not_running())
                self._inbox.release(stream)
        if self.error is not None:
            self._engine.shutdown()  # no step will run again: stop the tensor-parallel workers
