"""A request's sequences (``n`` parallel samples) and how its outputs are reported."""

from __future__ import annotations

from cb_serve.engine.detokenizer import IncrementalDetokenizer
from cb_serve.engine.processor import ProcessedRequest
from cb_serve.engine.sequence import Sequence
from cb_serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cb_serve.sampling_params import RequestOutputKind


class RequestState:
    def __init__(self, request_id: str, req: ProcessedRequest, tokenizer, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = req.prompt
        self.prompt_token_ids = req.prompt_token_ids
        self.params = req.params
        n = req.params.n
        self.seqs = [
            Sequence(
                request_id if n == 1 else f"{request_id}#{i}",
                request_id,
                i,
                req.prompt_token_ids,
                req.params.for_child(i) if n > 1 else req.params,
                req.max_tokens,
                arrival_time,
            )
            for i in range(n)
        ]
        self.detokenizers = [
            IncrementalDetokenizer(
                tokenizer,
                req.prompt_token_ids,
                req.params.skip_special_tokens,
                req.params.stop,
                req.params.include_stop_str_in_output,
            )
            if tokenizer is not None
            else None
            for _ in range(n)
        ]
        self.sent_text = [0] * n  # for DELTA outputs: how much text/tokens each client has
        self.sent_tokens = [0] * n

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def make_output(self, changed: set[int]) -> RequestOutput | None:
        """The output to report after a step that changed children ``changed``."""
        kind = self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        indices = sorted(changed) if kind == RequestOutputKind.DELTA else range(len(self.seqs))
        completions = [self._completion(i, delta=kind == RequestOutputKind.DELTA) for i in indices]
        completions = [c for c in completions if c is not None]
        if kind == RequestOutputKind.DELTA and not completions and not finished:
            return None
        first = self.seqs[0]
        metrics = RequestMetrics(
            arrival_time=first.times.arrival,
            first_scheduled_time=min(
                (s.times.first_scheduled for s in self.seqs if s.times.first_scheduled), default=None
            ),
            first_token_time=min((s.times.first_token for s in self.seqs if s.times.first_token), default=None),
            last_token_time=max((s.times.last_token for s in self.seqs if s.times.last_token), default=None),
            finished_time=max((s.times.finished or 0.0 for s in self.seqs), default=None) if finished else None,
            num_cached_tokens=first.num_cached_tokens,
            num_preemptions=sum(s.num_preemptions for s in self.seqs),
        )
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, finished, metrics, first.num_cached_tokens
        )

    def _completion(self, i: int, delta: bool) -> CompletionOutput | None:
        seq, detok = self.seqs[i], self.detokenizers[i]
        text = detok.visible_text(seq.is_finished) if detok is not None else ""
        token_ids = seq.output_token_ids
        logprobs = seq.logprobs if self.params.logprobs is not None else None
        if delta:
            t0, n0 = self.sent_text[i], self.sent_tokens[i]
            if len(text) == t0 and len(token_ids) == n0 and not seq.is_finished:
                return None
            self.sent_text[i], self.sent_tokens[i] = len(text), len(token_ids)
            text, token_ids = text[t0:], token_ids[n0:]
            logprobs = logprobs[n0:] if logprobs is not None else None
        return CompletionOutput(
            index=i,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=seq.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        )
