"""Asyncio front of the engine: the step loop runs in a background thread; any number of
coroutines call ``generate`` and iterate their outputs.

The boundary between the callers (any thread, usually an event loop) and the engine thread:

- Every call crosses as one item of an inbox that the engine thread drains between steps, and
  each item is handled on its own: one that raises fails only itself.
- Each ``generate`` call has its own ``_Stream``. The engine thread delivers a request's outputs
  to the stream that added it, and an abort names its stream, so nothing of an earlier request
  (a late output, a late abort) can reach a later one that reuses its id.
- A request id is held from the ``generate`` call until the engine holds nothing of the
  request. A new call with an id still held waits up to ``REQUEST_ID_WAIT_S`` for it (a client
  that gives up and retries at once with the same id gets through as soon as the abort lands),
  then gets ``RequestIdInUseError``.
- A call whose caller gave up (a cancelled ``inspect``) is skipped, and no delivery can raise.
- Once the loop has ended (it died, or ``shutdown``), nothing waits on it: what is in the inbox
  and every open stream fail at once, and an item sent later fails as it is sent. Registering
  a stream and sending its request is one step under ``_lock``, and so are marking the loop
  ended and ``close_streams``, so no call slips between them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from cb_serve.config import EngineConfig
from cb_serve.engine.llm_engine import LLMEngine, StepListener
from cb_serve.engine.processor import ProcessedRequest
from cb_serve.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
    RequestFailedError,
    RequestIdInUseError,
)
from cb_serve.inputs import PromptType
from cb_serve.outputs import RequestOutput
from cb_serve.prefix_hash import PrefixDigest
from cb_serve.sampling_params import SamplingParams
from cb_serve.stats import EngineStats

logger = logging.getLogger(__name__)

# How long a request waits for an earlier request with its id to end (client retries reuse ids).
REQUEST_ID_WAIT_S = 2.0


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
        pass


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Delivers to a future the engine thread owns (its caller may have given up meanwhile)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


class _Stream:
    """One ``generate`` call: its outputs (engine thread to caller) and whether the engine
    still holds anything of it (``ended``, set under ``AsyncLLM._lock``)."""

    __slots__ = ("request_id", "loop", "queue", "ended", "waiters")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.ended = False
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []  # calls waiting for its id

    def put(self, item: RequestOutput | BaseException) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


# Inbox items: ("add", stream, ProcessedRequest) | ("abort", stream) | ("call", future, function)
_Item = tuple[str, Any, Any]


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
        # The engine thread detokenizes with its own tokenizer; callers tokenize with this copy.
        self.tokenizer = copy.deepcopy(self._engine.tokenizer)
        self.processor = self._engine.processor.with_tokenizer(self.tokenizer)
        self._inbox: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _streams, _closing, _loop_ended and sending to the inbox
        self._streams: dict[str, _Stream] = {}  # request id -> the stream holding it (callers' side)
        self._live: dict[str, _Stream] = {}  # request id -> stream, of the requests the engine holds (engine thread)
        self._loop_ended = False
        self._closing: EngineError | None = None  # set by close_streams(): new requests are refused
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._stats = self._engine.get_stats()
        self._digest = self._engine.cache_digest()
        self._digest_wanted = False
        self._thread = threading.Thread(target=self._loop, name="cb-serve-engine", daemon=True)
        self._thread.start()

    # ---- caller side ----------------------------------------------------------------
    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        with self._lock:
            self._check_accepting()
        processed = self.processor.process(prompt, params)
        stream = await self._register(request_id, processed)
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

    def _check_accepting(self) -> None:
        """Raises ``EngineUnavailableError`` unless new requests are taken (call under ``_lock``)."""
        if self._loop_ended or self.error is not None or self._closing is not None:
            state = "shutting down" if self._closing is not None else "not running"
            raise EngineUnavailableError(f"The engine is {state}; retry the request.")

    async def _register(self, request_id: str, processed: ProcessedRequest) -> _Stream:
        """Holds ``request_id`` for a new stream and sends its request, in one step under the
        lock; first waits (up to ``REQUEST_ID_WAIT_S``) for an earlier holder of the id to end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REQUEST_ID_WAIT_S
        while True:
            with self._lock:
                self._check_accepting()
                held = self._streams.get(request_id)
                if held is None:
                    if self._is_full():
                        limit = self.config.max_waiting_requests
                        message = f"The engine's waiting queue is full ({limit} requests); retry later."
                        raise EngineOverloadedError(message)
                    stream = self._streams[request_id] = _Stream(request_id)
                    self._inbox.put(("add", stream, processed))  # _check_accepting: the loop drains it
                    self._wake.set()
                    return stream
                waiter = (loop, asyncio.Event())
                held.waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter[1].wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise RequestIdInUseError(
                    f"Request id {request_id!r} is in use by a request in flight; use another id.", "x-request-id"
                ) from None
            finally:
                with self._lock:
                    if waiter in held.waiters:
                        held.waiters.remove(waiter)

    def _is_full(self) -> bool:
        """Whether the requests this engine holds (running, waiting or not yet taken by the engine
        thread) fill ``max_num_seqs`` running slots plus ``max_waiting_requests``. Counted on the
        callers' side, where concurrent arrivals see exact counts (the engine's own numbers lag a step)."""
        limit = self.config.max_waiting_requests
        return limit is not None and len(self._streams) >= self.config.max_num_seqs + limit

    def _send(self, item: _Item) -> None:
        """Queues ``item`` for the engine thread, or fails it at once if the loop has ended."""
        with self._lock:
            if not self._loop_ended:
                self._inbox.put(item)
                self._wake.set()
                return
        self._fail_item(item, self._not_running())

    def get_stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its latest step."""
        return self._stats

    def get_cache_digest(self) -> PrefixDigest | None:
        """What the prefix cache held when the engine thread last refreshed this (None without
        prefix caching). Each call asks for a refresh after the current step, so polling every
        P seconds gives digests at most P seconds plus one step old, and costs nothing unpolled."""
        if not self._digest_wanted:
            self._digest_wanted = True
            self._wake.set()
        return self._digest

    async def inspect(self, what: str, timeout_s: float = 10.0, **kwargs: Any) -> Any:
        """``LLMEngine.inspect(what, **kwargs)``, taken on the engine thread between two steps.
        Cancelling the caller is safe: the engine thread skips a call nobody waits for."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", future, functools.partial(self._engine.inspect, what, **kwargs)))
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

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
        with self._lock:
            self._closing = error
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(copy.copy(error))  # one instance per caller: each raises (and annotates) its own
            self._send(("abort", stream, None))

    def check_health(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"The engine loop died: {self.error!r}") from self.error
        if not self._thread.is_alive():
            raise EngineDeadError("The engine loop is not running.")

    def shutdown(self) -> None:
        """Ends open streams with ``EngineShutdownError`` and stops the engine thread."""
        self.close_streams(EngineShutdownError("The server is shutting down; retry the request."))
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        engine = self._engine
        try:
            while not self._stop:
                self._wake.clear()
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    self._snapshot()
                    self._wake.wait(timeout=1.0)
                    continue
                outputs = engine.step()  # contains every failure it can survive
                self._snapshot()  # before the outputs: a caller sees stats at least as new
                for out in outputs:
                    self._deliver(out)
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on; callers are told at once
            logger.exception("engine loop died")
            self.error = e
        finally:
            self._end_loop()

    def _snapshot(self) -> None:
        self._stats = self._engine.get_stats()
        if self._digest_wanted:
            self._digest_wanted = False
            self._digest = self._engine.cache_digest()

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._live.get(out.request_id)
        if stream is None:
            return
        stream.put(out.error if out.error is not None else out)
        if out.finished:
            del self._live[out.request_id]
            self._end(stream)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._handle(item)
            except Exception as e:  # noqa: BLE001 - one item's failure, never the loop's
                logger.error("engine call %r failed", item[0], exc_info=e)
                if item[0] != "call":
                    self._forget(item[1])
                self._fail_item(item, RequestFailedError("This request failed on the server."))

    def _handle(self, item: _Item) -> None:
        op, target, payload = item
        if op == "call":
            if target.set_running_or_notify_cancel():  # False: its caller gave up
                try:
                    result = payload()
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    _settle(target, error=e)
                else:
                    _settle(target, result)
            return
        request_id = target.request_id
        if op == "abort":
            if self._live.get(request_id) is target:  # not an earlier request's late abort
                del self._live[request_id]
                self._engine.abort_request(request_id)
            self._end(target)
            return
        assert op == "add" and request_id not in self._live, (op, request_id)
        try:
            self._engine.add_processed_request(request_id, payload)
        except (ValueError, EngineOverloadedError) as e:  # the request's own input, or a full queue
            self._fail_item(item, e)
            return
        self._live[request_id] = target

    def _forget(self, stream: _Stream) -> None:
        """Engine thread: drops whatever the engine holds of ``stream``'s request (not of another
        stream's request with the same id)."""
        holder = self._live.get(stream.request_id)
        if holder is stream:
            del self._live[stream.request_id]
        if holder in (None, stream):
            try:
                self._engine.abort_request(stream.request_id)
            except Exception:  # noqa: BLE001 - best effort; the stream ends anyway
                logger.exception("aborting request %s failed", stream.request_id)

    def _fail_item(self, item: _Item, error: BaseException) -> None:
        """Ends an item the engine did not take (any thread): its caller gets ``error``."""
        op, target, _ = item
        if op == "call":
            if target.set_running_or_notify_cancel():  # False: its caller gave up
                _settle(target, error=error)
            return
        if op == "add":
            target.put(error)
        self._end(target)

    def _end(self, stream: _Stream) -> None:
        """The engine holds nothing of ``stream`` any more: its request id is free again."""
        with self._lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
            stream.ended = True
            waiters, stream.waiters = stream.waiters, []
        for loop, event in waiters:
            _call_soon(loop, event.set)

    def _not_running(self) -> EngineError:
        if self._closing is not None:
            return EngineShutdownError("The server is shutting down; retry the request.")
        return EngineUnavailableError("The engine is not running; retry the request.")

    def _end_loop(self) -> None:
        """The loop has ended: everything sent to it or waiting on it fails now, and anything
        sent later fails as it is sent (``_send``)."""
        with self._lock:
            self._loop_ended = True
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._fail_item(item, self._not_running())
        for stream in list(self._live.values()):
            if self.error is not None:
                stream.put(EngineDeadError("The engine replica failed; retry the request."))
            else:
                stream.put(self._not_running())
            self._end(stream)
        self._live.clear()
        with self._lock:
            left = list(self._streams.values())  # registered as the loop ended (their add failed above)
        for stream in left:
            stream.put(self._not_running())
            self._end(stream)
        try:
            self._engine.abort_request(list(self._engine.requests))
        except Exception:  # noqa: BLE001 - best effort: the replica is replaced anyway
            logger.exception("freeing the requests of the stopped engine failed")
