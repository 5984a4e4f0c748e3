"""The front end's ``OutputProcessor`` (vLLM v1's): the engine's ``EngineCoreOutput`` records into the
``RequestOutput``s clients see, one ``RequestState`` per request, for the synchronous ``LLMEngine``
(``AsyncLLM`` keeps each request's state in its ``generate`` coroutine instead, and processes records
there). Detokenizing, stop strings and output assembly all happen here, never in the engine's step."""

from __future__ import annotations

import logging
from collections.abc import Callable

from cb_serve.engine.core_output import EngineCoreOutput, by_request
from cb_serve.engine.request_state import RequestState
from cb_serve.errors import RequestFailedError
from cb_serve.outputs import RequestOutput

logger = logging.getLogger(__name__)

# (request id, output): every output the front end makes; None once a request ends without a finished
# output (its caller left, or it failed)
OutputListener = Callable[[str, RequestOutput | None], None]

# (request id, index, stop string, output tokens kept): a sequence a stop string ended that the
# engine still runs
RequestStop = tuple[str, int, str, int]


class OutputListeners:
    """Who hears of every output the front end makes (``add_output_listener`` of ``LLMEngine`` and
    ``AsyncLLM``): each runs where the output is made, must be quick, and never raises into it."""

    def __init__(self) -> None:
        self.listeners: tuple[OutputListener, ...] = ()

    def add(self, listener: OutputListener) -> None:
        self.listeners = (*self.listeners, listener)

    def remove(self, listener: OutputListener) -> None:
        self.listeners = tuple(x for x in self.listeners if x is not listener)

    def notify(self, request_id: str, out: RequestOutput | None) -> None:
        for listener in self.listeners:
            try:
                listener(request_id, out)
            except Exception:  # noqa: BLE001 - an observer must not fail the request
                logger.exception("output listener %r failed", listener)


class OutputProcessor:
    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        self.num_parallel = 0  # requests with n > 1 (without any, a step has one record per request)

    def add_request(self, state: RequestState) -> None:
        assert state.request_id not in self.states, state.request_id
        self.states[state.request_id] = state
        self.num_parallel += len(state.seqs) > 1

    def _forget(self, request_id: str) -> RequestState | None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.num_parallel -= len(state.seqs) > 1
        return state

    def abort(self, request_id: str) -> bool:
        """Forgets the request; False if it held nothing of it."""
        return self._forget(request_id) is not None

    def process_outputs(
        self, records: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[RequestStop], list[str]]:
        """The step's outputs, the stops the engine must hear of (``EngineCore.stop_sequence``), and the
        requests whose processing failed here (each has its error output; the engine must end them). A
        request leaves once its client has its last output."""
        outputs: list[RequestOutput] = []
        stops: list[RequestStop] = []
        failed: list[str] = []
        groups = by_request(records).items() if self.num_parallel else ((r.request_id, [r]) for r in records)
        for request_id, group in groups:
            state = self.states.get(request_id)
            if state is None:  # ended here (a stop string) while the engine still ran it
                continue
            try:
                out, seq_stops = state.process(group)
            except Exception as e:  # noqa: BLE001 - this request's own failure (its detokenizer, say)
                logger.error("request %s failed while its output was made", request_id, exc_info=e)
                self._forget(request_id)
                outputs.append(state.failed_output(RequestFailedError("This request failed on the server.")))
                failed.append(request_id)
                continue
            if out is not None:
                outputs.append(out)
            stops += [(request_id, *stop) for stop in seq_stops]
            if state.finished:
                self._forget(request_id)
        return outputs, stops, failed
