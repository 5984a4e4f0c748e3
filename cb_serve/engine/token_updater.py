"""``TokenUpdater.update_from_output``: what a step's sampled tokens do to their sequences, on the
engine thread (vLLM v1's ``Scheduler.update_from_output``).

Each emitted token is appended, counted and checked for the stops that need no text (stop token ids
and EOS after ``min_tokens``, ``max_tokens``, the context length, a complete grammar); a speculating
sequence's accepted drafts have their KV counted as computed; the tokens a grammar forces next are
appended without a step of their own (jump-forward). Each advanced sequence then gets one compact
``EngineCoreOutput``; a finished request leaves the engine's table. Text, stop strings and the
``RequestOutput`` are the front end's (``output_processor.py``), off this thread.
"""

from __future__ import annotations

import time

from cb_serve.engine.core_output import EngineCoreOutput
from cb_serve.engine.core_request import CoreRequest
from cb_serve.engine.scheduler import Scheduler
from cb_serve.fault_injection import FaultInjector
from cb_serve.model_executor.step_output import StepResult
from cb_serve.outputs import Logprob
from cb_serve.sequence import Sequence, SequenceStatus
from cb_serve.structured_outputs.manager import StructuredOutputManager

MAX_JUMP_TOKENS = 64  # forced tokens appended to one sequence between two steps

NewLogprobs = list[dict[int, Logprob] | None] | None


class TokenUpdater:
    def __init__(
        self,
        requests: dict[str, CoreRequest],
        scheduler: Scheduler,
        structured: StructuredOutputManager,
        max_model_len: int,
    ) -> None:
        self.requests = requests  # the engine's table: a finished request leaves it here
        self.scheduler = scheduler
        self.structured = structured
        self.max_model_len = max_model_len
        self.prompt_tokens = self.generation_tokens = 0  # cumulative, as vLLM counts them

    def update_from_output(self, result: StepResult) -> tuple[list[EngineCoreOutput], dict[str, BaseException]]:
        """The records of the sequences the step advanced, and the requests that failed on the way
        (their own failure: the engine ends them)."""
        now = time.monotonic()
        records: list[EngineCoreOutput] = []
        failed: dict[str, BaseException] = {}
        for seq, entries in result.prompt_logprobs:  # the first output token's record carries them all
            if not seq.is_finished and seq.request_id in self.requests:
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs.append(None)  # the first prompt token has none
                seq.prompt_logprobs.extend(entries)
        for seq, emitted, logprobs in zip(result.sampling_seqs, result.token_ids, result.logprobs):
            if seq.request_id in failed or seq.is_finished:  # finished: while its step was in flight (async)
                continue
            request = self.requests[seq.request_id]
            start = seq.num_output_tokens
            new_logprobs: NewLogprobs = [] if request.wants_logprobs else None
            try:
                self._append_emitted(request, seq, emitted, logprobs, now, new_logprobs)
                self._jump_forward(request, seq, now, new_logprobs)
                FaultInjector.before_output(request.faults)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                failed[seq.request_id] = e
                continue
            finally:
                seq.spec_token_ids = []
            records.append(self._record(request, seq, start, new_logprobs, now))
        return records, failed

    def _record(
        self, request: CoreRequest, seq: Sequence, start: int, new_logprobs: NewLogprobs, now: float
    ) -> EngineCoreOutput:
        done = seq.is_finished and request.finished
        if done:
            del self.requests[seq.request_id]
        prompt_logprobs = None
        if start == 0 and seq.index == 0 and request.params.prompt_logprobs is not None:
            prompt_logprobs = seq.prompt_logprobs or [None]
        return EngineCoreOutput(
            seq.request_id,
            seq.index,
            seq.output_token_ids_from(start),
            new_logprobs,
            seq.status.finish_reason,
            seq.stop_reason,
            done,
            now,
            seq.times.first_scheduled,
            seq.num_preemptions,
            seq.num_cached_tokens,
            prompt_logprobs,
        )

    def _append_emitted(
        self,
        request: CoreRequest,
        seq: Sequence,
        emitted: list[int],
        logprobs: list,
        now: float,
        new_logprobs: NewLogprobs,
    ) -> None:
        """The sampled token; after drafts, the accepted ones and the target's token after them, each
        draft's KV counted as computed once it is accepted. A stop among them ends the sequence there."""
        for i, token_id in enumerate(emitted):
            if i:  # the previous token was an accepted draft: this step wrote its KV
                seq.num_computed_tokens += 1
            self.append_token(request, seq, token_id, logprobs[i], now, new_logprobs)
            if seq.is_finished:
                return
        if len(emitted) > 1 or seq.spec_token_ids:  # not on the plain decode's hot path (update_after_step committed
            self.scheduler.block_manager.commit_computed(seq)  # its blocks): the accepted drafts', a verify's save

    def _jump_forward(self, request: CoreRequest, seq: Sequence, now: float, new_logprobs: NewLogprobs) -> None:
        """Appends the tokens the grammar forces next: they join the sequence's next step as a chunk."""
        if seq.is_finished or seq.matcher is None:  # only a grammar forces tokens
            return
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens, MAX_JUMP_TOKENS)
        for token_id in self.structured.forced_tokens(seq, room):
            self.append_token(request, seq, token_id, None, now, new_logprobs, forced=True)
            if seq.is_finished:
                return

    def append_token(
        self,
        request: CoreRequest,
        seq: Sequence,
        token_id: int,
        logprobs: dict | None,
        now: float,
        new_logprobs: NewLogprobs,
        forced: bool = False,
    ) -> None:
        seq.append_token(token_id, now, forced)
        self.generation_tokens += 1
        if not request.prompt_tokens_counted:
            request.prompt_tokens_counted = True
            self.prompt_tokens += seq.num_prompt_tokens
        if new_logprobs is not None:
            new_logprobs.append(logprobs)
        complete = self.structured.accept_token(seq, token_id)
        at_limit = seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len
        decision = request.stop_checker.update(token_id, seq.num_output_tokens, at_limit, None)
        if decision is None and complete:
            decision = ("stop", None)  # the grammar is complete
        if decision is not None:
            reason, seq.stop_reason = decision
            status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
            self.scheduler.finish(seq, status)
