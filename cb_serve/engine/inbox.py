"""The channel from callers (any thread, usually an event loop) to the engine thread, and the
request ids it holds.

- Each ``generate`` call has its own ``Stream``: the engine thread delivers a request's outputs
  to the stream that added it, and an abort names its stream, so nothing of an earlier request
  (a late output, a late abort) can reach a later one that reuses its id.
- A request id is held from the ``generate`` call until the engine holds nothing of the
  request (``release``). A new call with an id still held waits up to ``REQUEST_ID_WAIT_S``
  for it (a client that gives up and retries at once with the same id gets through as soon as
  the abort lands), then gets ``RequestIdInUseError``.
- Holding an id and queuing its request is one step under ``lock``, and so are closing
  (``close_streams``) and ending (the loop stopped): no call slips between them. Once ended,
  nothing is queued: ``put`` says so and the caller fails the item itself (``fail``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

from cb_serve.engine.core_output import EngineCoreOutput, by_request
from cb_serve.errors import EngineError, EngineOverloadedError, EngineUnavailableError, RequestIdInUseError

# How long a request waits for an earlier request with its id to end (client retries reuse ids).
REQUEST_ID_WAIT_S = 2.0

# ("add", Stream, ProcessedRequest) | ("abort", Stream, None | "failed")
# | ("stop", Stream, [(index, stop string, output tokens kept)])
# | ("call", concurrent Future, function)
Item = tuple[str, Any, Any]


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
        pass


def put_all(items: list[tuple[Stream, list[EngineCoreOutput]]]) -> None:
    """In a stream's event loop: each item into its stream's queue (a step's records for this loop)."""
    for stream, item in items:
        stream.queue.put_nowait(item)


def by_stream_and_loop(
    live: dict[str, Stream], records: list[EngineCoreOutput]
) -> tuple[dict[asyncio.AbstractEventLoop, list[tuple[Stream, list[EngineCoreOutput]]]], list[Stream]]:
    """A step's records of the requests in ``live`` (request id -> stream; a finished request leaves
    it), one list per stream, grouped by the streams' event loops; and the streams whose request the
    engine let go of."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, list[EngineCoreOutput]]]] = {}
    ended = []
    for request_id, group in by_request(records).items():
        stream = live.get(request_id)
        if stream is None:
            continue
        by_loop.setdefault(stream.loop, []).append((stream, group))
        if group[-1].request_finished:  # the request's last record: none follows it
            del live[request_id]
            ended.append(stream)
    return by_loop, ended


def settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Delivers to a future the engine thread runs (``set_running_or_notify_cancel`` passed);
    never raises, whatever happened to the future meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


async def wait_or_timeout(future: asyncio.Future, timeout_s: float) -> bool:
    """Waits for ``future`` (True: done), at most ``timeout_s``; cancels it if not done. Unlike
    ``asyncio.wait_for`` in Python 3.11, a cancellation of the caller always raises, even when
    ``future`` completes in the same turn of the loop."""
    try:
        done, _ = await asyncio.wait({future}, timeout=max(0.0, timeout_s))
    finally:
        if not future.done():
            future.cancel()
    return bool(done)


class Stream:
    """One ``generate`` call: its outputs, from the engine thread to the caller's loop."""

    __slots__ = ("request_id", "loop", "queue", "ended", "waiters")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[EngineCoreOutput] | BaseException] = asyncio.Queue()
        self.ended = False  # the engine holds nothing of it (set under Inbox.lock)
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []  # calls waiting for its id

    def put(self, item: list[EngineCoreOutput] | BaseException) -> None:
        call_soon(self.loop, self.queue.put_nowait, item)


class Inbox:
    """What callers send the engine thread, which drains it between steps."""

    def __init__(self, capacity: int | None, full_message: str = "The engine is full; retry later.") -> None:
        self.capacity = capacity  # requests held at most (None: no limit)
        self.full_message = full_message
        self.lock = threading.Lock()
        self.streams: dict[str, Stream] = {}  # request id -> the stream holding it
        self.closing: EngineError | None = None  # close(): new requests are refused
        self.ended = False  # the engine loop has ended: nothing is queued any more
        self.wake = threading.Event()
        self._items: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def check_open(self) -> None:
        """Raises ``EngineUnavailableError`` unless new requests are taken (under ``lock``)."""
        if self.ended or self.closing is not None:
            state = "shutting down" if self.closing is not None else "not running"
            raise EngineUnavailableError(f"The engine is {state}; retry the request.")

    def put(self, item: Item) -> bool:
        """Queues ``item`` for the engine thread; False once the loop has ended."""
        with self.lock:
            if self.ended:
                return False
            self._items.put(item)
            self.wake.set()
            return True

    def get(self) -> Item | None:
        try:
            return self._items.get_nowait()
        except queue.Empty:
            return None

    def qsize(self) -> int:
        return self._items.qsize()

    async def add(self, request_id: str, processed: Any) -> Stream:
        """Holds ``request_id`` for a new stream and queues its request, in one step; first
        waits (up to ``REQUEST_ID_WAIT_S``) for an earlier holder of the id to be released."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REQUEST_ID_WAIT_S
        while True:
            with self.lock:
                self.check_open()
                held = self.streams.get(request_id)
                if held is None:
                    if self.capacity is not None and len(self.streams) >= self.capacity:
                        raise EngineOverloadedError(self.full_message)
                    stream = self.streams[request_id] = Stream(request_id)
                    self._items.put(("add", stream, processed))
                    self.wake.set()
                    return stream
                waiter = (loop, asyncio.Event())
                held.waiters.append(waiter)
            try:
                released = await wait_or_timeout(asyncio.ensure_future(waiter[1].wait()), deadline - loop.time())
            finally:
                with self.lock:
                    if waiter in held.waiters:
                        held.waiters.remove(waiter)
            if not released:
                message = f"Request id {request_id!r} is in use by a request in flight; use another id."
                raise RequestIdInUseError(message, "x-request-id")

    def release(self, stream: Stream) -> None:
        """The engine holds nothing of ``stream`` any more: its request id is free again."""
        with self.lock:
            if self.streams.get(stream.request_id) is stream:
                del self.streams[stream.request_id]
            stream.ended = True
            waiters, stream.waiters = stream.waiters, []
        for loop, event in waiters:
            call_soon(loop, event.set)

    def fail(self, item: Item, error: BaseException) -> None:
        """Ends an item the engine did not take (any thread): its caller gets ``error``."""
        op, target, _ = item
        if op == "call":
            if target.set_running_or_notify_cancel():  # False: its caller gave up
                settle(target, error=error)
            return
        if op in ("add", "stop"):  # a stop: the caller may still wait for its other sequences
            target.put(error)
        self.release(target)

    def close(self, error: EngineError) -> list[Stream]:
        """Refuses new requests from now on; the streams open now."""
        with self.lock:
            self.closing = error
            return list(self.streams.values())

    def end(self) -> tuple[list[Item], list[Stream]]:
        """The loop has ended: what was queued, and the streams still held."""
        with self.lock:
            self.ended = True
        items = []
        while (item := self.get()) is not None:
            items.append(item)
        with self.lock:
            return items, list(self.streams.values())
