"""The front end's state of one request (vLLM v1's ``RequestState`` in its output processor): per
sequence its detokenizer, tokens, logprobs, times and end, and the ``RequestOutput``s a client sees.
It runs where the caller is (``AsyncLLM.generate``'s coroutine, or ``LLMEngine.step`` after the core
step), never on the engine thread: the engine hands it ``EngineCoreOutput`` records.

Stop strings are decided here. A sequence that hits one ends at that token: any token the engine
made after it (a later step, launched ahead or run before the engine heard) is dropped, and the stop
goes back to the engine (``process``'s second result). The same ``StopChecker`` the engine runs
decides stop tokens, ``min_tokens`` and the length, so both sides agree on every other stop; a stop
string found in the token that also reached the length wins, as it did on the engine.
"""

from __future__ import annotations

from cb_serve.engine.core_output import EngineCoreOutput, PromptLogprobs
from cb_serve.engine.detokenizer import IncrementalDetokenizer, rust_tokenizer
from cb_serve.engine.processor import ProcessedRequest
from cb_serve.engine.stop_checker import StopChecker, StopDecision
from cb_serve.errors import EngineError
from cb_serve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from cb_serve.sampling_params import RequestOutputKind

# (index, stop string, its output tokens): a sequence the front end ended on a stop string while the
# engine runs it, and how many tokens it kept
SequenceStop = tuple[int, str, int]


class SeqOutput:
    """One sequence as the client sees it."""

    __slots__ = (
        "token_ids",
        "logprobs",
        "cumulative_logprob",
        "finish_reason",
        "stop_reason",
        "first_scheduled",
        "first_token",
        "last_token",
        "finished_time",
        "num_preemptions",
    )

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0


class RequestState:
    def __init__(self, request_id: str, req: ProcessedRequest, tokenizer, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = req.prompt
        self.prompt_token_ids = req.prompt_token_ids
        self.params = req.params
        self.lora_request = req.lora_request
        self.arrival_time = arrival_time
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}  # logprob tokens decoded so far
        self.stop_checker = StopChecker(req.params)
        n = req.params.n
        self.seqs = [SeqOutput() for _ in range(n)]
        rust = rust_tokenizer(tokenizer)
        self.detokenizers = [
            IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.skip_special_tokens, rust)
            if tokenizer is not None
            else None
            for _ in range(n)
        ]
        self.sent_text = [0] * n  # for DELTA outputs: how much text/tokens each client has
        self.sent_tokens = [0] * n
        self.num_cached_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False
        self.engine_finished = False  # the engine has let go of the request
        self.num_unfinished = n  # sequences without a finish reason

    @property
    def finished(self) -> bool:
        return not self.num_unfinished

    def process(self, records: list[EngineCoreOutput]) -> tuple[RequestOutput | None, list[SequenceStop]]:
        """One step's records of this request: its output (None when nothing is to be reported), and
        the sequences a stop string ended that the engine still runs."""
        changed: set[int] = set()
        stops: list[SequenceStop] = []
        for rec in records:
            self.engine_finished |= rec.request_finished
            if rec.error is not None:
                return self.failed_output(rec.error), []
            s = self.seqs[rec.index]
            if s.finish_reason is not None:  # ended here already: what the engine made since is dropped
                continue
            changed.add(rec.index)
            if self._apply(s, rec) and not rec.finished:
                stops.append((rec.index, s.stop_reason, len(s.token_ids)))
        if self.engine_finished and self.num_unfinished:  # an abort (``EngineCore._end``) ends them all
            for i, s in enumerate(self.seqs):
                if s.finish_reason is None:
                    s.finish_reason, s.finished_time = records[-1].finish_reason or "abort", records[-1].time
                    changed.add(i)
            self.num_unfinished = 0
        return (self.make_output(changed) if changed else None), stops

    def _apply(self, s: SeqOutput, rec: EngineCoreOutput) -> bool:
        """Appends the record's tokens up to a stop; True when a stop string ended the sequence."""
        s.first_scheduled, s.num_preemptions = rec.first_scheduled_time, rec.num_preemptions
        if rec.index == 0:
            self.num_cached_tokens = rec.num_cached_tokens
        if rec.new_prompt_logprobs is not None:
            self.prompt_logprobs = [None if e is None else self.with_token_text(e) for e in rec.new_prompt_logprobs]
        ids, logprobs, detok = rec.new_token_ids, rec.new_logprobs, self.detokenizers[rec.index]
        if ids:
            s.first_token = s.first_token or rec.time
            s.last_token = rec.time
        if logprobs is None and not rec.finished and not self.stop_checker.stop_strings:
            # the hot path: the engine found no stop in these tokens, and there is no stop string to find
            s.token_ids += ids
            if detok is not None:
                for token_id in ids:
                    detok.append(token_id)
            return False
        last = len(ids) - 1
        decision: StopDecision | None = None
        for j, token_id in enumerate(ids):
            s.token_ids.append(token_id)
            if logprobs is not None and (entry := logprobs[j]) is not None:  # a forced token has none
                s.logprobs.append(self.with_token_text(entry))
                s.cumulative_logprob += entry[token_id].logprob
            at_limit = j == last and rec.finish_reason == "length"
            decision = self.stop_checker.update(token_id, len(s.token_ids), at_limit, detok)
            if decision is not None:
                break
        if decision is None and rec.finished:
            decision = (rec.finish_reason, rec.stop_reason)  # a complete grammar, an abort
        if decision is None:
            return False
        s.finish_reason, s.stop_reason = decision
        s.finished_time = rec.time
        self.num_unfinished -= 1
        return isinstance(s.stop_reason, str)

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
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            finished,
            self._metrics(finished),
            self.num_cached_tokens,
            lora_request=self.lora_request,
            prompt_logprobs=self._prompt_logprobs(kind),
        )

    def failed_output(self, error: EngineError) -> RequestOutput:
        """The request's last output when it failed: every sequence ends with "error"."""
        for s in self.seqs:
            s.finish_reason = s.finish_reason or "error"
        self.num_unfinished = 0
        completions = [CompletionOutput(i, "", [], finish_reason="error") for i in range(len(self.seqs))]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, True, error=error)

    def _metrics(self, finished: bool) -> RequestMetrics:
        """The request's times: its arrival, the earliest first scheduling and first token, the latest
        token and finish, over its sequences."""
        seqs = self.seqs
        if len(seqs) == 1:
            s = seqs[0]
            return RequestMetrics(
                self.arrival_time,
                s.first_scheduled,
                s.first_token,
                s.last_token,
                (s.finished_time or 0.0) if finished else None,
                s.num_preemptions,
            )
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min((s.first_scheduled for s in seqs if s.first_scheduled), default=None),
            first_token_time=min((s.first_token for s in seqs if s.first_token), default=None),
            last_token_time=max((s.last_token for s in seqs if s.last_token), default=None),
            finished_time=max((s.finished_time or 0.0 for s in seqs), default=None) if finished else None,
            num_preemptions=sum(s.num_preemptions for s in seqs),
        )

    def _prompt_logprobs(self, kind: RequestOutputKind) -> list | None:
        """The prompt logprobs once computed (they are, once a token was sampled): in every output, or
        only the first for DELTA outputs (as vLLM)."""
        if self.prompt_logprobs is None:
            return None
        if kind == RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def _completion(self, i: int, delta: bool) -> CompletionOutput | None:
        """Completion ``i`` so far (or, with ``delta``, what is new since the last one): O(new
        text) for deltas, whatever the output length."""
        s, detok = self.seqs[i], self.detokenizers[i]
        done = s.finish_reason is not None
        text_end = 0
        if detok is not None:
            text_end = len(detok.text) if done else max(0, len(detok.text) - self.stop_checker.holdback)
        want_logprobs = self.params.logprobs is not None
        t0, n0 = (self.sent_text[i], self.sent_tokens[i]) if delta else (0, 0)
        num_tokens = len(s.token_ids)
        if delta:
            if text_end <= t0 and num_tokens == n0 and not done:
                return None
            self.sent_text[i], self.sent_tokens[i] = max(t0, text_end), num_tokens
        return CompletionOutput(
            index=i,
            text=detok.text[t0:text_end] if detok is not None else "",
            token_ids=s.token_ids[n0:],
            cumulative_logprob=s.cumulative_logprob if want_logprobs else None,
            logprobs=s.logprobs[n0:] if want_logprobs else None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
