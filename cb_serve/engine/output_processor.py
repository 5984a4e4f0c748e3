"""``OutputProcessor.update_from_output``: what a step's sampled tokens do to their requests.

Each emitted token is appended, counted and checked for a stop (stop tokens and strings,
``max_tokens``, the context length, a complete grammar); a speculating sequence's accepted drafts
have their KV counted as computed; the tokens a grammar forces next are appended without a step of
their own (jump-forward); then each advanced request's output is made and a finished one leaves
the engine's table.

This is one module beside the scheduler rather than the scheduler's ``update_from_output`` (vLLM
v1 puts stop tokens in its scheduler and stop strings in a front-end ``OutputProcessor``): stop
strings need the request's detokenizer and end sequences in the same step as stop tokens, so one
owner decides every stop, and the scheduler stays a tokenizer-free allocator of tokens and blocks.
"""

from __future__ import annotations

import time

from cb_serve.engine.request_state import RequestState
from cb_serve.engine.scheduler import Scheduler
from cb_serve.fault_injection import FaultInjector
from cb_serve.model_executor.model_runner import StepResult
from cb_serve.outputs import RequestOutput
from cb_serve.sequence import Sequence, SequenceStatus
from cb_serve.structured_outputs.manager import StructuredOutputManager

MAX_JUMP_TOKENS = 64  # forced tokens appended to one sequence between two steps


class OutputProcessor:
    def __init__(
        self,
        requests: dict[str, RequestState],
        scheduler: Scheduler,
        structured: StructuredOutputManager,
        max_model_len: int,
    ) -> None:
        self.requests = requests  # the engine's table: a finished request leaves it here
        self.scheduler = scheduler
        self.structured = structured
        self.max_model_len = max_model_len
        self.prompt_tokens = self.generation_tokens = 0  # cumulative, as vLLM counts them

    def update_from_output(self, result: StepResult) -> tuple[list[RequestOutput], dict[str, BaseException]]:
        """The outputs of the requests the step advanced, and the requests that failed on the way
        (their own failure: the engine ends them)."""
        now = time.monotonic()
        changed: dict[str, set[int]] = {}
        failed: dict[str, BaseException] = {}
        for seq, entries in result.prompt_logprobs:  # before the tokens: the output that has them carries them
            if not seq.is_finished and seq.request_id in self.requests:
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs.append(None)  # the first prompt token has none
                state = self.requests[seq.request_id]
                seq.prompt_logprobs.extend(state.with_token_text(e) for e in entries)
        for seq, emitted, logprobs in zip(result.sampling_seqs, result.token_ids, result.logprobs):
            if seq.request_id in failed or seq.is_finished:  # finished: while its step was in flight (async)
                continue
            try:
                self._append_emitted(seq, emitted, logprobs, now)
                self._jump_forward(seq, now)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                failed[seq.request_id] = e
            finally:
                seq.spec_token_ids = []
            changed.setdefault(seq.request_id, set()).add(seq.index)
        return self._make_outputs(changed, failed), failed

    def _append_emitted(self, seq: Sequence, emitted: list[int], logprobs: list, now: float) -> None:
        """The sampled token; after drafts, the accepted ones and the target's token after them, each
        draft's KV counted as computed once it is accepted. A stop among them ends the sequence there."""
        for i, token_id in enumerate(emitted):
            if i:  # the previous token was an accepted draft: this step wrote its KV
                seq.num_computed_tokens += 1
            self.append_token(seq, token_id, logprobs[i], now)
            if seq.is_finished:
                return
        if len(emitted) > 1:  # not on the plain decode's hot path: update_after_step committed its blocks
            self.scheduler.block_manager.commit_computed(seq)  # blocks the accepted drafts filled

    def _jump_forward(self, seq: Sequence, now: float) -> None:
        """Appends the tokens the grammar forces next: they join the sequence's next step as a chunk."""
        if seq.is_finished or seq.matcher is None:  # only a grammar forces tokens
            return
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens, MAX_JUMP_TOKENS)
        for token_id in self.structured.forced_tokens(seq, room):
            self.append_token(seq, token_id, None, now, forced=True)
            if seq.is_finished:
                return

    def append_token(
        self, seq: Sequence, token_id: int, logprobs: dict | None, now: float, forced: bool = False
    ) -> None:
        seq.append_token(token_id, now, forced)
        self.generation_tokens += 1
        state = self.requests[seq.request_id]
        if not state.prompt_tokens_counted:
            state.prompt_tokens_counted = True
            self.prompt_tokens += seq.num_prompt_tokens
        if logprobs is not None:
            seq.logprobs.append(state.with_token_text(logprobs))
            seq.cumulative_logprob += logprobs[token_id].logprob
        complete = self.structured.accept_token(seq, token_id)
        at_limit = seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len
        decision = state.stop_checker.update(token_id, seq.num_output_tokens, at_limit, state.detokenizers[seq.index])
        if decision is None and complete:
            decision = ("stop", None)  # the grammar is complete
        if decision is not None:
            reason, seq.stop_reason = decision
            status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
            self.scheduler.finish(seq, status)

    def _make_outputs(self, changed: dict[str, set[int]], failed: dict[str, BaseException]) -> list[RequestOutput]:
        outputs = []
        for request_id, indices in changed.items():
            if request_id in failed:
                continue
            state = self.requests[request_id]
            try:
                FaultInjector.before_output(state.faults)
                out = state.make_output(indices)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                failed[request_id] = e
                continue
            if out is not None:
                outputs.append(out)
            if state.finished:
                del self.requests[request_id]
        return outputs
