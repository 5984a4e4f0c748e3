"""Asyncio front of the engine: the step loop runs in a background thread; any number of
coroutines call ``generate`` and iterate their outputs.

The engine thread runs steps and hands each stream its records (token ids, ``EngineCoreOutput``);
the front end, each ``generate`` coroutine with its request's ``RequestState``, detokenizes, checks
stop strings and makes the outputs, so that work overlaps the engine's next step. A stop string
goes back to the engine as a ``stop`` item.

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
from cb_serve.engine.engine_loop import EngineLoop
from cb_serve.engine.inbox import (
    Inbox,
    Item,
    Stream,
    wait_or_timeout,
)
from cb_serve.engine.llm_engine import LLMEngine, StepListener
from cb_serve.engine.output_processor import OutputListener
from cb_serve.engine.request_state import RequestState
from cb_serve.errors import (
    EngineDeadError,
    EngineError,
    EngineShutdownError,
    RequestFailedError,
)
from cb_serve.inputs import PromptType, carries_images
from cb_serve.lora_request import LoRARequest
from cb_serve.model_executor.device_context import concrete_device
from cb_serve.outputs import RequestOutput
from cb_serve.prefix_hash import PrefixDigest
from cb_serve.sampling_params import SamplingParams
from cb_serve.stats import EngineStats

logger = logging.getLogger(__name__)


class AsyncLLM(EngineLoop):
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
        # Callers tokenize and detokenize with this copy; the engine thread has its own (grammars).
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
        if carries_images(prompt):  # decoding and hashing images: off the event loop
            processed = await asyncio.to_thread(self.processor.process, prompt, params)
        else:
            processed = self.processor.process(prompt, params)
        processed.priority = self._engine.checked_priority(priority)
        if lora_request is not None:
            processed.lora_weights = await asyncio.to_thread(self._engine.read_lora, lora_request)
            processed.lora_request = lora_request
        state = RequestState(request_id, processed, self.tokenizer, processed.arrival_time)
        stream = await self._inbox.add(request_id, processed)
        left = True  # the engine still runs it and nothing told it to stop: leaving aborts it
        reported = False  # the output listeners had its last output
        try:
            while not state.finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    left = False
                    raise item
                try:
                    out, stops = state.process(item)
                except Exception as e:  # noqa: BLE001 - this request's own failure: the engine goes on
                    logger.error("request %s failed while its output was made", request_id, exc_info=e)
                    self._send(("abort", stream, "failed"))  # the engine lets go of it, counted as failed
                    out, stops = state.failed_output(RequestFailedError("This request failed on the server.")), []
                if stops:  # stop strings: the engine stops those sequences (and lets go of the request)
                    self._send(("stop", stream, stops))
                left = not (state.engine_finished or state.finished)
                if out is None:
                    continue
                self._engine.output_listeners.notify(request_id, out)
                reported = out.finished
                if out.error is not None:
                    raise out.error
                yield out
        finally:
            if left:
                self._send(("abort", stream, None))
            if not reported:
                self._engine.output_listeners.notify(request_id, None)

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

    def add_output_listener(self, listener: OutputListener) -> None:
        """``listener(request_id, output)`` runs in the caller's coroutine for every ``RequestOutput`` a
        ``generate`` call makes (before the caller sees it), and with None when a request ends without a
        finished output: queue what you need and return. An exception in it is logged, never raised."""
        self._engine.add_output_listener(listener)

    def remove_output_listener(self, listener: OutputListener) -> None:
        self._engine.remove_output_listener(listener)

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
