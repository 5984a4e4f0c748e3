"""Compiles constraints off the engine's step thread and caches what it compiled, by constraint
(one compiler per backend, so per tokenizer). A request whose grammar is not ready waits
without a running slot (the scheduler skips it)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable

from cb_serve.structured_outputs.base import CompiledGrammar, GrammarBackend
from cb_serve.structured_outputs_params import StructuredOutputsParams


class GrammarCompiler:
    """``submit`` returns a future of the compiled grammar: a cached one at once, or one compiling
    on the worker thread. A compile that fails is not cached (its future carries the
    ``InvalidRequestError``). The wall seconds of each successful compile (the backend's one-off
    tokenizer setup excluded; cache hits are none) wait in ``drain_compile_times``."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], max_cached: int = 512) -> None:
        """``make_backend`` is called once, on the worker thread (wrapping a tokenizer can take a second)."""
        assert max_cached > 0
        self._make_backend = make_backend
        self.backend: GrammarBackend | None = None
        self.max_cached = max_cached
        self._cache: OrderedDict[str, concurrent.futures.Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cb-serve-grammar")
        # Guarded by _lock: written by the worker, drained by the engine's steps (bounded, should none run).
        self._compile_times: deque[float] = deque(maxlen=max_cached)
        self._running: tuple[str, float] | None = None  # (key, monotonic start) of the compile in progress

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future[CompiledGrammar]:
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._cache[key] = self._pool.submit(self._compile, params, key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        # Not a callback holding self: the cached future would keep its compiler (and its thread) in a cycle.
        future.add_done_callback(functools.partial(_forget_failure, weakref.ref(self), key))
        return future

    def _compile(self, params: StructuredOutputsParams, key: str) -> CompiledGrammar:
        if self.backend is None:
            self.backend = self._make_backend()
        start = time.perf_counter()
        with self._lock:
            self._running = (key, time.monotonic())
        try:
            compiled = self.backend.compile(params)
        finally:
            with self._lock:
                self._running = None
        with self._lock:
            self._compile_times.append(time.perf_counter() - start)
        return compiled

    def compiling_since(self, key: str) -> float | None:
        """When the compile of ``key`` began (monotonic), while it runs; None while it waits its turn."""
        with self._lock:
            running = self._running
        return running[1] if running is not None and running[0] == key else None

    def drain_compile_times(self) -> tuple[float, ...]:
        """The seconds of the compiles that succeeded since the previous call, each given once."""
        with self._lock:
            times = tuple(self._compile_times)
            self._compile_times.clear()
        return times

    def _forget_failure(self, key: str, future: concurrent.futures.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _forget_failure(compiler: weakref.ref[GrammarCompiler], key: str, future: concurrent.futures.Future) -> None:
    owner = compiler()
    if owner is not None:
        owner._forget_failure(key, future)
