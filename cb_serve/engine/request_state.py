"""A request's sequences (``n`` parallel samples) and how its outputs are reported."""

from __future__ import annotations

import itertools

from cb_serve.engine.detokenizer import IncrementalDetokenizer, rust_tokenizer
from cb_serve.engine.processor import ProcessedRequest
from cb_serve.engine.stop_checker import StopChecker
from cb_serve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cb_serve.sampling_params import RequestOutputKind
from cb_serve.sequence import Sequence

_SEQ_IDS = itertools.count()  # unique in the process: request ids are the clients' and may look like anything


class RequestState:
    def __init__(
        self,
        request_id: str,
        req: ProcessedRequest,
        tokenizer,
        arrival_time: float,
        faults: frozenset[str] = frozenset(),
    ) -> None:
        self.request_id = request_id
        self.prompt = req.prompt
        self.prompt_token_ids = req.prompt_token_ids
        self.params = req.params
        self.faults = faults  # fault-injection kinds this request carries (tests)
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}  # logprob tokens decoded so far
        self.stop_checker = StopChecker(req.params)
        n = req.params.n
        self.seqs = [
            Sequence(
                next(_SEQ_IDS),
                request_id,
                i,
                req.prompt_token_ids,
                req.params.for_child(i) if n > 1 else req.params,
                req.max_tokens,
                arrival_time,
                self.stop_checker.stop_ids,
                req.lora_request,
                req.priority,
            )
            for i in range(n)
        ]
        rust = rust_tokenizer(tokenizer)
        self.detokenizers = [
            IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.skip_special_tokens, rust)
            if tokenizer is not None
            else None
            for _ in range(n)
        ]
        self.sent_text = [0] * n  # for DELTA outputs: how much text/tokens each client has
        self.sent_tokens = [0] * n
        self.prompt_tokens_counted = False  # counted once per request (vLLM), whatever n
        self.prompt_logprobs_sent = False

    @property
    def finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    def with_token_text(self, logprobs: dict[int, Logprob]) -> dict[int, Logprob]:
        """Fills in each logprob's ``decoded_token`` (the token decoded alone)."""
        if self.tokenizer is None:
            return logprobs
        for token_id, lp in logprobs.items():
            text = self.token_texts.get(token_id)
            if text is None:
                text = self.token_texts[token_id] = self.tokenizer.decode([token_id])
            lp.decoded_token = text
        return logprobs

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
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            finished,
            self._metrics(finished),
            first.num_cached_tokens,
            lora_request=first.lora,
            prompt_logprobs=self._prompt_logprobs(kind),
        )

    def _metrics(self, finished: bool) -> RequestMetrics:
        """The request's times: its first sequence's arrival, the earliest first scheduling and first
        token, the latest token and finish, over its sequences."""
        if len(self.seqs) == 1:
            t = self.seqs[0].times
            return RequestMetrics(
                arrival_time=t.arrival,
                first_scheduled_time=t.first_scheduled or None,
                first_token_time=t.first_token or None,
                last_token_time=t.last_token or None,
                finished_time=(t.finished or 0.0) if finished else None,
                num_preemptions=self.seqs[0].num_preemptions,
            )
        times = [s.times for s in self.seqs]
        return RequestMetrics(
            arrival_time=times[0].arrival,
            first_scheduled_time=min((t.first_scheduled for t in times if t.first_scheduled), default=None),
            first_token_time=min((t.first_token for t in times if t.first_token), default=None),
            last_token_time=max((t.last_token for t in times if t.last_token), default=None),
            finished_time=max((t.finished or 0.0 for t in times), default=None) if finished else None,
            num_preemptions=sum(s.num_preemptions for s in self.seqs),
        )

    def _prompt_logprobs(self, kind: RequestOutputKind) -> list | None:
        """The prompt logprobs once computed (they are, once a token was sampled): in every output, or
        only the first for DELTA outputs (as vLLM)."""
        first = self.seqs[0]
        if self.params.prompt_logprobs is None or first.needs_prompt_logprobs or first.num_output_tokens == 0:
            return None
        if kind == RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return first.prompt_logprobs or [None]

    def _completion(self, i: int, delta: bool) -> CompletionOutput | None:
        """Completion ``i`` so far (or, with ``delta``, what is new since the last one): O(new
        text) for deltas, whatever the output length."""
        seq, detok = self.seqs[i], self.detokenizers[i]
        text_end = 0
        if detok is not None:
            text_end = len(detok.text) if seq.is_finished else max(0, len(detok.text) - self.stop_checker.holdback)
        want_logprobs = self.params.logprobs is not None
        t0, n0 = (self.sent_text[i], self.sent_tokens[i]) if delta else (0, 0)
        if delta:
            if text_end <= t0 and seq.num_output_tokens == n0 and not seq.is_finished:
                return None
            self.sent_text[i], self.sent_tokens[i] = max(t0, text_end), seq.num_output_tokens
        return CompletionOutput(
            index=i,
            text=detok.text[t0:text_end] if detok is not None else "",
            token_ids=seq.output_token_ids_from(n0),
            cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
            logprobs=seq.logprobs[n0:] if want_logprobs else None,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        )
