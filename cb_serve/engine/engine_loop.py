"""The engine thread's side of ``AsyncLLM`` (``EngineLoop``, its base class): it drains the inbox
between steps (requests in, aborts, stop strings the front end found, calls), runs the engine's core
step, hands each stream its records, and fails everything at once when the loop ends. The caller
side, and the state both sides share, are ``AsyncLLM``'s (``async_llm.py``)."""

from __future__ import annotations

import logging
import threading

from cb_serve.engine.core_output import EngineCoreOutput
from cb_serve.engine.gc_heap import frozen_heap
from cb_serve.engine.inbox import Inbox, Item, Stream, by_stream_and_loop, call_soon, put_all, settle
from cb_serve.engine.llm_engine import LLMEngine
from cb_serve.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
    RequestFailedError,
)
from cb_serve.model_executor.device_context import bind_thread_to_device
from cb_serve.prefix_hash import PrefixDigest
from cb_serve.stats import EngineStats

logger = logging.getLogger(__name__)


class EngineLoop:
    """Runs on the engine thread alone (``_loop``); ``AsyncLLM`` sets these up."""

    _engine: LLMEngine
    _inbox: Inbox
    _live: dict[str, Stream]  # request id -> stream, of the requests the engine holds
    _stop: bool
    _thread: threading.Thread
    _device: object
    _stats: EngineStats
    _digest: PrefixDigest | None
    _digest_wanted: bool
    error: BaseException | None

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
            records = engine.core_step()  # contains every failure it can survive
            self._snapshot()  # before the records: a caller sees stats at least as new
            self._deliver(records)

    def _snapshot(self) -> None:
        self._stats = self._engine.get_stats()
        if self._digest_wanted:
            self._digest_wanted = False
            self._digest = self._engine.cache_digest()

    def _deliver(self, records: list[EngineCoreOutput]) -> None:
        """Hands a step's records to their streams, one list per stream: one wake-up per event loop."""
        by_loop, ended = by_stream_and_loop(self._live, records)
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
        if op == "stop":  # the front end found stop strings
            if self._live.get(request_id) is target:
                for index, stop, num_tokens in payload:
                    if self._engine.stop_sequence(request_id, index, stop, num_tokens):  # the request is done
                        del self._live[request_id]
                        self._inbox.release(target)
                        break
            return
        if op == "abort":  # payload "failed": the front end failed it
            if self._live.get(request_id) is target:  # not an earlier request's late abort
                del self._live[request_id]
                self._engine.abort_request(request_id)
                if payload == "failed":
                    self._engine.stats.num_failed_requests += 1
            self._inbox.release(target)
            return
        assert op == "add" and request_id not in self._live, (op, request_id)
        try:
            self._engine.add_engine_request(request_id, payload)
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
