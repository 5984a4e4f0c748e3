"""Requests with a constraint wait here, holding no running slot and no KV block, while their
grammar compiles on the compiler's thread; ``admit`` (at the start of each step) hands those
whose grammar is ready to the scheduler, each sequence with its own matcher."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time

from cb_serve.engine.request_state import RequestState
from cb_serve.engine.scheduler import Scheduler
from cb_serve.errors import InvalidRequestError
from cb_serve.structured_outputs.compiler import GrammarCompiler
from cb_serve.structured_outputs.params import PARAM, ConstraintLimits

logger = logging.getLogger(__name__)


def _llguidance_backend(tokenizer, vocab_size: int):
    from cb_serve.structured_outputs.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size)


class GrammarAdmission:
    def __init__(self, tokenizer, vocab_size: int, limits: ConstraintLimits | None = None) -> None:
        self.limits = limits or ConstraintLimits()
        self._make_backend = functools.partial(_llguidance_backend, tokenizer, vocab_size)
        self._compiler: GrammarCompiler | None = None  # made on the first constrained request
        self.waiting: dict[str, tuple[RequestState, concurrent.futures.Future, float]] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._make_backend)
        return self._compiler

    def add(self, state: RequestState) -> None:
        future = self.compiler.submit(state.params.structured_outputs)
        self.waiting[state.request_id] = (state, future, time.monotonic() + self.limits.compile_timeout_s)

    def drop(self, request_id: str) -> bool:
        """Forgets a waiting request (aborted, failed); whether it was waiting."""
        return self.waiting.pop(request_id, None) is not None

    def admit(self, scheduler: Scheduler) -> list[tuple[str, InvalidRequestError]]:
        """Schedules the requests whose grammar is ready; returns those refused (their constraint
        did not compile, or not within ``compile_timeout_s``), which stay in the engine's table."""
        refused: list[tuple[str, InvalidRequestError]] = []
        now = time.monotonic()
        for request_id, (state, future, deadline) in list(self.waiting.items()):
            if not future.done():
                if now > deadline:
                    del self.waiting[request_id]
                    message = f"{PARAM}: compiling took over {self.limits.compile_timeout_s} s."
                    refused.append((request_id, InvalidRequestError(message, PARAM)))
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

    def wait(self, timeout_s: float) -> None:
        """Blocks until a waiting grammar is ready, at most ``timeout_s`` (none waiting: returns)."""
        futures = [future for _, future, _ in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
