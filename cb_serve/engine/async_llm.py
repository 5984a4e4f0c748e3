"""Asyncio front of the engine: the step loop runs in a background thread; any number of
coroutines call ``generate`` and iterate their outputs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator
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
)
from cb_serve.inputs import PromptType
from cb_serve.outputs import RequestOutput
from cb_serve.prefix_hash import PrefixDigest
from cb_serve.sampling_params import SamplingParams
from cb_serve.stats import EngineStats

logger = logging.getLogger(__name__)


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass


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
        # (op, request id or view, payload): "add" a ProcessedRequest, "abort", "call" (future, function)
        self._inbox: queue.SimpleQueue[tuple[str, str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._closing: EngineError | None = None  # set by close_streams(): new requests are refused
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
        if not self.is_alive or self._closing is not None:
            state = "shutting down" if self._closing is not None else "not running"
            raise EngineUnavailableError(f"The engine is {state}; retry the request.")
        processed = self.processor.process(prompt, params)
        if self._is_full():
            limit = self.config.max_waiting_requests
            raise EngineOverloadedError(f"The engine's waiting queue is full ({limit} requests); retry later.")
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        stream = self._streams[request_id] = _Stream()
        finished = False
        try:
            self._send("add", request_id, processed)
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def _is_full(self) -> bool:
        """Whether the requests this engine holds (running, waiting or not yet taken by the engine
        thread) fill ``max_num_seqs`` running slots plus ``max_waiting_requests``. Counted on the
        callers' side, where concurrent arrivals see exact counts (the engine's own numbers lag a step)."""
        limit = self.config.max_waiting_requests
        return limit is not None and len(self._streams) >= self.config.max_num_seqs + limit

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id, None)

    def _send(self, op: str, request_id: str, processed: ProcessedRequest | None) -> None:
        self._inbox.put((op, request_id, processed))
        self._wake.set()

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
        """``LLMEngine.inspect(what, **kwargs)``, taken on the engine thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", what, (future, functools.partial(self._engine.inspect, what, **kwargs))))
        self._wake.set()
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
        """Refuses new requests (``EngineUnavailableError``) and ends every open stream with
        ``error`` (its request is aborted). For shutdown: no stream is left hanging."""
        self._closing = error
        for request_id, stream in list(self._streams.items()):
            self.abort(request_id)
            stream.put(error)

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
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out.error if out.error is not None else out)
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on; callers are told at once
            logger.exception("engine loop died")
            self.error = e
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError("The engine replica failed; retry the request."))
            try:
                engine.abort_request(list(engine.requests))
            except Exception:  # noqa: BLE001 - best effort: the replica is replaced anyway
                logger.exception("freeing the requests of the dead engine failed")

    def _snapshot(self) -> None:
        self._stats = self._engine.get_stats()
        if self._digest_wanted:
            self._digest_wanted = False
            self._digest = self._engine.cache_digest()

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, request_id, processed = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "abort":
                self._engine.abort_request(request_id)
                continue
            if op == "call":
                future, call = processed
                try:
                    future.set_result(call())
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    future.set_exception(e)
                continue
            try:
                self._engine.add_processed_request(request_id, processed)
            except Exception as e:  # noqa: BLE001 - one request's failure, never the loop's
                if not isinstance(e, (ValueError, EngineOverloadedError)):
                    logger.error("adding request %s failed", request_id, exc_info=e)
                    e = RequestFailedError("This request failed on the server.")
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put(e)
