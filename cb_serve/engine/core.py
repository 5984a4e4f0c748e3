"""``EngineCore``: the request table and the step (vLLM v1's engine core): admit, schedule,
execute, update. A step returns one ``EngineCoreOutput`` per advanced sequence: token ids, no
text (the front end's ``OutputProcessor`` makes the outputs). Each capability joins the step at one
named line of ``step`` or ``_execute``; failures are contained here, at this one level, and every
request ends through ``_end``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from cb_serve.engine.builder import EngineParts
from cb_serve.engine.core_output import EngineCoreOutput
from cb_serve.engine.core_request import CoreRequest
from cb_serve.engine.stats_recorder import StatsRecorder, StepInProgress
from cb_serve.engine.token_updater import TokenUpdater
from cb_serve.errors import EngineFatalError, EngineOverloadedError, RequestFailedError, StepFailedError
from cb_serve.model_executor.step_output import AsyncStepOutput, StepResult
from cb_serve.sequence import SchedulerOutput, SequenceStatus
from cb_serve.spec_decode.speculator import NoSpeculation

logger = logging.getLogger(__name__)

# A step failure fails its requests and the engine goes on; this many in a row mean the
# engine itself is broken (a sticky device error, say), so it stops and the replica is replaced.
MAX_CONSECUTIVE_STEP_FAILURES = 3
GRAMMAR_POLL_S = 0.01  # the longest a step with nothing to run waits for a grammar being compiled


def waiting_queue_full(num_waiting: int, num_running: int, max_waiting: int | None, max_num_seqs: int) -> bool:
    """Whether one more request would leave more than ``max_waiting`` requests waiting for one of
    the ``max_num_seqs`` running slots (queued requests fill free slots first)."""
    return max_waiting is not None and num_waiting >= max_waiting + max(0, max_num_seqs - num_running)


def async_scheduling_enabled(
    config_value: bool | None, device_type: str, executor_supports: bool, speculating: bool
) -> bool:
    """Whether steps are launched ahead (``EngineConfig.async_scheduling``): by default on CUDA, where the
    host's work overlaps the device's; never with speculation (its proposer reads each step's tokens) or an
    executor that cannot feed sampled ids back on the device (tensor parallelism: the driver alone samples)."""
    wanted = device_type == "cuda" if config_value is None else config_value
    return wanted and executor_supports and not speculating


@dataclass
class InFlightStep:
    """A step launched ahead (async scheduling) whose sampled ids are not on the host yet."""

    number: int  # launches so far, this one included (``Sequence.last_step``)
    sched: SchedulerOutput
    stats: StepInProgress
    output: AsyncStepOutput


class EngineCore:
    """One model on one device. Not thread-safe: drive it from one thread (see AsyncLLM)."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.config = parts.config
        self.scheduler, self.executor = parts.scheduler, parts.executor
        self.structured, self.speculator, self.inspector = parts.structured, parts.speculator, parts.inspector
        self.faults = parts.faults
        self.requests: dict[str, CoreRequest] = {}
        self.token_updater = TokenUpdater(self.requests, self.scheduler, self.structured, parts.setup.max_model_len)
        self.stats = StatsRecorder(
            self.scheduler,
            self.token_updater,
            self.structured,
            self.speculator,
            parts.lora,
            self.inspector,
            parts.cpu_kernels,
            parts.weight_bytes,
            self.executor.runner.encoder_cache,
        )
        self.consecutive_step_failures = 0
        speculating = not isinstance(self.speculator, NoSpeculation)
        self.async_scheduling = async_scheduling_enabled(
            self.config.async_scheduling, parts.setup.device.type, self.executor.supports_async_scheduling, speculating
        )
        if self.config.async_scheduling and not self.async_scheduling:
            logger.warning("async_scheduling is off: speculative decoding and tensor parallelism step synchronously")
        self.in_flight: InFlightStep | None = None
        self.num_launched = 0
        self.sync_request_ids: set[str] = set()  # live requests whose steps run synchronously (needs_host_each_step)

    # ---- requests -------------------------------------------------------------------
    def check_capacity(self) -> None:
        """``EngineOverloadedError`` when the waiting queue is full (``max_waiting_requests``)."""
        s = self.scheduler
        if waiting_queue_full(len(s.waiting), len(s.running), self.config.max_waiting_requests, s.max_num_seqs):
            limit = self.config.max_waiting_requests
            raise EngineOverloadedError(f"The engine's waiting queue is full ({limit} requests).")

    def add_core_request(self, state: CoreRequest) -> None:
        """Queues a validated request: its sequences go to the scheduler, or with a constraint to
        the structured outputs manager until their grammar is compiled (off this thread). The caller
        has checked ``check_capacity`` (before it took in the request's adapter)."""
        s = self.scheduler
        self.requests[state.request_id] = state
        self.stats.note_added(state)
        if state.params.needs_host_each_step:
            self.sync_request_ids.add(state.request_id)
        constraint = state.params.structured_outputs
        if self.inspector is not None:
            seq = state.seqs[0]
            self.inspector.on_arrival(
                state.request_id, seq.times.arrival, seq.num_prompt_tokens, len(state.seqs), constraint is not None
            )
        if constraint is not None:
            self.structured.add_request(state.request_id, constraint, state.seqs)
            return
        for seq in state.seqs:
            s.add(seq)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if request_id in self.requests:
                self._end(request_id, SequenceStatus.FINISHED_ABORTED)

    def stop_sequence(self, request_id: str, index: int, stop: str, num_output_tokens: int) -> bool:
        """The front end ended sequence ``index`` of the request on stop string ``stop`` after
        ``num_output_tokens`` tokens: it stops (its blocks free once no step in flight writes them), and
        the tokens made after the stop are not counted as generated. True when that ended the request (it
        left the engine's table)."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        seq = state.seqs[index]
        if not seq.is_finished:
            seq.stop_reason = stop
            self.token_updater.generation_tokens -= max(0, seq.num_output_tokens - num_output_tokens)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            if self.inspector is not None:
                self.inspector.on_finished_outside_step([seq], "stop", self.stats.num_steps)
        if not state.finished:
            return False
        del self.requests[request_id]
        self.stats.note_ended(state)
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests are live, or a step is in flight (async scheduling: one more ``step`` collects it)."""
        return bool(self.requests) or self.in_flight is not None

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedules and runs one step: the records of the sequences it advanced or ended."""
        start = time.monotonic()
        outputs = self._admit()  # structured outputs: requests whose grammar is ready join the queue
        if self.async_scheduling and self._can_launch_ahead():  # async scheduling: launch N+1, then take N's
            return self._step_ahead(start, outputs)
        outputs += self._drain()  # a step in flight first: the next one needs the host to see its tokens
        self.speculator.propose(self.scheduler.running)  # speculation: drafts ride along in the ragged batch
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._idle(outputs)
        step = self.stats.begin(start, sched)
        result = self._execute(sched, step, outputs)  # None: the step failed (its requests' ends in outputs)
        return outputs if result is None else self._finish(step, sched, result, outputs)

    def _finish(
        self, step: StepInProgress, sched: SchedulerOutput, result: StepResult, outputs: list[EngineCoreOutput]
    ) -> list[EngineCoreOutput]:
        """The step's tokens into its requests (stops, outputs), then its stats."""
        outputs += self._update_from_output(result)
        self.stats.record(step, sched, result, outputs)
        return outputs

    # ---- async scheduling: step N+1 scheduled and launched while step N runs -----------
    def _can_launch_ahead(self) -> bool:
        ids = self.sync_request_ids
        if ids:
            ids.intersection_update(self.requests)  # requests that left
        return not ids

    def _step_ahead(self, start: float, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Schedules and launches the next step, then takes the outputs of the one in flight: the
        host's work for both overlaps the device's (the step's ids reach the next one on the device)."""
        sched = self.scheduler.schedule()  # in-flight tokens count as pending: each running sequence gets its next
        launched = None if sched.is_empty else self._launch(sched, self.stats.begin(start, sched), outputs)
        prev, self.in_flight = self.in_flight, launched
        if prev is not None:
            return self._collect(prev, outputs)
        return self._idle(outputs) if launched is None else outputs

    def _launch(
        self, sched: SchedulerOutput, step: StepInProgress, outputs: list[EngineCoreOutput]
    ) -> InFlightStep | None:
        """Launches ``sched``: its sequences' tokens count as computed and each sampling one has a token
        pending. A failure is contained as ``_execute``'s (None)."""
        self.num_launched += 1
        for seq in sched.seqs:
            seq.last_step = self.num_launched
        try:
            if self.faults is not None:
                kinds = {k for seq in sched.seqs for k in self.requests[seq.request_id].faults}
                self.faults.before_step(self.stats.num_steps + self.stats.num_failed_steps + 1, kinds)
            output = self.executor.launch(sched)
        except EngineFatalError:
            raise
        except Exception as e:  # noqa: BLE001 - contained: the step's requests fail, the engine goes on
            self._sync_device()  # whatever of it was launched has run, as has every step before it
            self.scheduler.steps_completed(self.num_launched)
            outputs += self._fail_step(sched, e)
            return None
        for seq in output.sampling_seqs:
            seq.num_pending_tokens += 1
        self.scheduler.update_after_step(sched)
        return InFlightStep(self.num_launched, sched, step, output)

    def _collect(self, prev: InFlightStep, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The outputs of the step in flight, once its sampled ids are on the host (a later step may still
        run). Sequences that ended meanwhile have their tokens dropped; those the step alone kept from their
        blocks give them back."""
        try:
            result = prev.output.result()
        except Exception as e:  # noqa: BLE001 - a device error surfaces at the wait
            self._steps_completed(prev.number)
            return outputs + self._fail_step(prev.sched, e)
        self._steps_completed(prev.number)
        prev.stats.executed = time.monotonic()
        self.consecutive_step_failures = 0
        for seq in result.sampling_seqs:
            seq.num_pending_tokens -= 1
        return self._finish(prev.stats, prev.sched, result, outputs)

    def _steps_completed(self, number: int) -> None:
        self.scheduler.steps_completed(number if self.in_flight is not None else self.num_launched)

    def _drain(self) -> list[EngineCoreOutput]:
        prev, self.in_flight = self.in_flight, None
        return [] if prev is None else self._collect(prev, [])

    def _sync_device(self) -> None:
        try:
            self.executor.runner.synchronize()
        except Exception:  # noqa: BLE001 - a broken device fails the next step instead
            logger.exception("device synchronize after a failed launch")

    # ---- requests join and leave -------------------------------------------------------
    def _admit(self) -> list[EngineCoreOutput]:
        """Sequences whose grammar compiled join the scheduler's queue; refused requests end."""
        ready, refused = self.structured.admit()
        for seq in ready:
            self.scheduler.add(seq)
        return [self._end(request_id, SequenceStatus.FINISHED_ERROR, error) for request_id, error in refused]

    def _idle(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        if not outputs:
            self.structured.wait(GRAMMAR_POLL_S)  # nothing to run until a grammar is compiled
        return outputs

    def _execute(
        self, sched: SchedulerOutput, step: StepInProgress, outputs: list[EngineCoreOutput]
    ) -> StepResult | None:
        """Runs the step on the executor. Failures are contained here: any exception but
        ``EngineFatalError`` fails the step's requests (``StepFailedError``, retryable; their
        outputs join ``outputs``) and frees their KV blocks, and the engine goes on; after
        ``MAX_CONSECUTIVE_STEP_FAILURES`` failed steps in a row it raises ``EngineFatalError``.
        (An exception while one request's output is processed fails that request alone:
        ``_update_from_output``.)"""
        try:
            if self.faults is not None:
                kinds = {k for seq in sched.seqs for k in self.requests[seq.request_id].faults}
                self.faults.before_step(self.stats.num_steps + self.stats.num_failed_steps + 1, kinds)
            sched.grammar_bitmask = self.structured.grammar_bitmask(sched)  # filled while the forward pass runs
            result = self.executor.execute(sched)  # LoRA slots are assigned as the runner prepares the batch
            self.scheduler.update_after_step(sched)
        except EngineFatalError:
            raise
        except Exception as e:  # noqa: BLE001 - contained: the step's requests fail, the engine goes on
            outputs += self._fail_step(sched, e)
            return None
        step.executed = time.monotonic()
        self.consecutive_step_failures = 0
        return result

    def _update_from_output(self, result: StepResult) -> list[EngineCoreOutput]:
        outputs, failed = self.token_updater.update_from_output(result)
        for request_id, e in failed.items():
            logger.error("request %s failed while its output was processed", request_id, exc_info=e)
            error = RequestFailedError("This request failed on the server.")
            outputs.append(self._end(request_id, SequenceStatus.FINISHED_ERROR, error))
        return outputs

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        self.stats.num_failed_steps += 1
        self.consecutive_step_failures += 1
        request_ids = list(dict.fromkeys(seq.request_id for seq in sched.seqs))
        logger.error("engine step failed; failing its %d request(s) %s", len(request_ids), request_ids, exc_info=error)
        if self.consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineFatalError(f"{self.consecutive_step_failures} engine steps failed in a row") from error
        failure = StepFailedError("The engine step running this request failed; retry the request.")
        return [self._end(r, SequenceStatus.FINISHED_ERROR, failure) for r in request_ids if r in self.requests]

    # ---- ending a request: the one path -----------------------------------------------
    def _end(self, request_id: str, status: SequenceStatus, error: Exception | None = None) -> EngineCoreOutput:
        """Ends every unfinished sequence of the request with ``status``, freeing its KV blocks (a
        request still waiting for its grammar holds none), and forgets it. Its last record carries
        ``error`` (an abort's record is dropped). A request that failed on its own, or was refused
        before it ran, is counted as failed; one aborted or failed with its step is named in the
        next step's ``ended_request_ids`` (no finished output reaches the step listeners)."""
        state = self.requests.pop(request_id)
        unfinished = [seq for seq in state.seqs if not seq.is_finished]
        never_scheduled = self.structured.drop(request_id)
        for seq in unfinished:
            if never_scheduled:
                seq.status = status
            else:
                self.scheduler.finish(seq, status)
        if self.inspector is not None:
            self.inspector.on_finished_outside_step(unfinished, status.finish_reason, self.stats.num_steps)
        if isinstance(error, (RequestFailedError, StepFailedError)):
            self.stats.num_failed_requests += 1
        if error is None or isinstance(error, StepFailedError):
            self.stats.note_ended(state)
        index = unfinished[0].index if unfinished else 0
        return EngineCoreOutput(
            request_id,
            index,
            [],
            finish_reason=status.finish_reason,
            request_finished=True,
            time=time.monotonic(),
            error=error,
        )
