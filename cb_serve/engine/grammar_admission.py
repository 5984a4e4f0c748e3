"""Requests with a constraint wait here, holding no running slot and no KV block, while their
grammar compiles on the compiler's thread; ``admit`` (at the start of each step) hands those
whose grammar is ready to the scheduler, each sequence with its own matcher."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections.abc import Iterator

from cb_serve.engine.request_state import RequestState
from cb_serve.engine.scheduler import Scheduler
from cb_serve.errors import EngineOverloadedError, InvalidRequestError
from cb_serve.sequence import Sequence
from cb_serve.structured_outputs.compiler import GrammarCompiler
from cb_serve.structured_outputs.params import PARAM, ConstraintLimits

logger = logging.getLogger(__name__)
MAX_WAIT_FACTOR = 6  # a request waits at most this many compile timeouts for its grammar, queue included


def _llguidance_backend(tokenizer, vocab_size: int):
    from cb_serve.structured_outputs.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size)


class GrammarAdmission:
    def __init__(self, tokenizer, vocab_size: int, limits: ConstraintLimits | None = None) -> None:
        self.limits = limits or ConstraintLimits()
        self._make_backend = functools.partial(_llguidance_backend, tokenizer, vocab_size)
        self._compiler: GrammarCompiler | None = None  # made on the first constrained request
        # request id -> (state, compiled grammar's future, constraint key, when it was added)
        self.waiting: dict[str, tuple[RequestState, concurrent.futures.Future, str, float]] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._make_backend)
        return self._compiler

    def add(self, state: RequestState) -> None:
        constraint = state.params.structured_outputs
        future = self.compiler.submit(constraint)
        self.waiting[state.request_id] = (state, future, constraint.key(), time.monotonic())

    def drop(self, request_id: str) -> bool:
        """Forgets a waiting request (aborted, failed); whether it was waiting."""
        return self.waiting.pop(request_id, None) is not None

    def admit(self, scheduler: Scheduler) -> list[tuple[str, Exception]]:
        """Schedules the requests whose grammar is ready; returns those refused (their constraint
        did not compile, or not within ``compile_timeout_s`` of compiling: the backend's one-off
        setup and the wait behind other compiles do not count), which stay in the engine's table."""
        refused: list[tuple[str, Exception]] = []
        now = time.monotonic()
        for request_id, (state, future, key, added) in list(self.waiting.items()):
            if not future.done():
                error = self._overdue(key, added, now)
                if error is not None:
                    del self.waiting[request_id]
                    refused.append((request_id, error))
                continue
            del self.waiting[request_id]
            error = future.exception()
            if error is not None:
                if not isinstance(error, InvalidRequestError):
                    logger.error("compiling the constraint of request %s failed", request_id, exc_info=error)
                    error = InvalidRequestError(f"{PARAM}: the constraint could not be compiled.", PARAM)
                refused.append((request_id, error))
                continue
            compiled = future.result()
            for seq in state.seqs:
                seq.matcher = compiled.matcher()
                scheduler.add(seq)
        return refused

    def _overdue(self, key: str, added: float, now: float) -> Exception | None:
        """A 400 when the request's own compile ran over ``compile_timeout_s``; a 503 (retry) when
        it waited ``MAX_WAIT_FACTOR`` times that behind other compiles."""
        timeout = self.limits.compile_timeout_s
        since = self.compiler.compiling_since(key)
        if since is not None and now > max(since, added) + timeout:
            return InvalidRequestError(f"{PARAM}: compiling took over {timeout} s.", PARAM)
        if now > added + MAX_WAIT_FACTOR * timeout:
            return EngineOverloadedError("The grammar compiler is busy with other requests' constraints; retry.")
        return None

    def drain_compile_times(self) -> tuple[float, ...]:
        """The seconds of the grammar compiles that succeeded since the previous call, each given once."""
        return () if self._compiler is None else self._compiler.drain_compile_times()

    def waiting_seqs(self) -> Iterator[Sequence]:
        """The sequences of the requests waiting for their grammar."""
        return (seq for state, *_ in self.waiting.values() for seq in state.seqs)

    def wait(self, timeout_s: float) -> None:
        """Blocks until a waiting grammar is ready, at most ``timeout_s`` (none waiting: returns)."""
        futures = [future for _, future, *_ in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
