"""What the engine did, step by step, for the batch inspector (``/inspect``), per-request
timelines and trace export: a bounded ring of step records, a bounded set of request
timelines, and the KV block map on demand.

Recording costs a few tuples per scheduled sequence per step and nothing per token. It holds
request ids and token counts only, never text. Everything here runs on the engine's thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from cb_serve.engine.block_manager import BlockManager
from cb_serve.engine.expert_heatmap import ExpertHeatmap
from cb_serve.engine.kv_map import kv_map
from cb_serve.kv_cache_interface import NULL_BLOCK
from cb_serve.multimodal.features import image_share
from cb_serve.sequence import SchedulerOutput, Sequence

MAX_KV_CELLS = 4096  # a larger cache is summarized: one cell per group of blocks
MAX_QUEUE_ROWS = 64  # running / waiting rows listed per snapshot (the rest are counted)


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: ``num_tokens`` computed after ``computed_before``.
    A prefill (prompt, or recomputation after a preemption) is cut in ``chunk``-numbered
    pieces until ``computed_before + num_tokens == target``; a decode is one sampled token."""

    request_id: str
    index: int
    num_tokens: int
    computed_before: int
    target: int  # tokens the sequence had when scheduled: caught up when computed reaches it
    is_decode: bool
    chunk: int  # 1, 2, ... for prefill chunks; 0 for decodes
    constrained: bool = False  # carries a grammar matcher (structured outputs)
    forced: int = 0  # of the tokens, those a grammar forced (jump-forward) after the previous step's sample
    drafted: int = 0  # of the tokens, drafts verified in this step (speculative decoding)
    accepted: int = 0  # of those drafts, the ones the target accepted
    image_tokens: int = 0  # of the tokens, image placeholders (taking an image's embeddings)
    images: int = 0  # the images those belong to

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "seq": self.index,
            "tokens": self.num_tokens,
            "computed_before": self.computed_before,
            "computed_after": self.computed_before + self.num_tokens,
            "target": self.target,
            "kind": "decode" if self.is_decode else "prefill",
            "chunk": self.chunk,
            "last_chunk": not self.is_decode and self.computed_before + self.num_tokens == self.target,
            "constrained": self.constrained,
            "forced": self.forced,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "image_tokens": self.image_tokens,
            "images": self.images,
        }


@dataclass(frozen=True, slots=True)
class StepRecord:
    step_id: int
    start: float  # wall clock (time.time() scale)
    duration_s: float
    token_budget: int
    seqs: tuple[ScheduledSeq, ...]
    admitted: tuple[tuple[str, int], ...]  # (request id, seq index) taken from the waiting queue
    preempted: tuple[tuple[str, int], ...]
    finished: tuple[tuple[str, int, str], ...]  # (request id, seq index, finish reason)
    kv_used: int
    kv_free: int
    kv_cached_free: int
    num_running: int
    num_waiting: int
    grammar_fill_s: float = 0.0  # the bitmask filler's seconds for the constrained rows (0: none)
    grammar_wait_s: float = 0.0  # sampling's wait for those bitmasks after the forward
    images_encoded: int = 0  # images run through the vision encoder for the step
    encoder_s: float = 0.0  # the encoder's host wall seconds

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_id,
            "start": self.start,
            "duration_s": self.duration_s,
            "token_budget": self.token_budget,
            "scheduled_tokens": self.num_scheduled_tokens,
            "seqs": [s.to_dict() for s in self.seqs],
            "admitted": [list(a) for a in self.admitted],
            "preempted": [list(p) for p in self.preempted],
            "finished": [list(f) for f in self.finished],
            "kv": {"used": self.kv_used, "free": self.kv_free, "cached_free": self.kv_cached_free},
            "running": self.num_running,
            "waiting": self.num_waiting,
            "grammar_fill_s": self.grammar_fill_s,
            "grammar_wait_s": self.grammar_wait_s,
            "images_encoded": self.images_encoded,
            "encoder_s": self.encoder_s,
        }


@dataclass
class RequestTimeline:
    """A request's life in the engine: events in order, decodes summarized per sequence."""

    request_id: str
    arrival: float  # wall clock
    num_prompt_tokens: int
    num_seqs: int
    constrained: bool = False  # its output follows a grammar (structured outputs)
    events: list[dict[str, Any]] = field(default_factory=list)
    decodes: dict[int, list[float]] = field(default_factory=dict)  # seq -> [steps, first step, last step, t0, t1]
    first_token: float | None = None
    finished: float | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def add(self, event: str, t: float, **details: Any) -> None:
        self.events.append({"event": event, "t": t, **details})

    def to_dict(self) -> dict[str, Any]:
        first_scheduled = next((e["t"] for e in self.events if e["event"] == "scheduled"), None)
        return {
            "request_id": self.request_id,
            "arrival": self.arrival,
            "prompt_tokens": self.num_prompt_tokens,
            "n": self.num_seqs,
            "constrained": self.constrained,
            "queue_wait_s": None if first_scheduled is None else first_scheduled - self.arrival,
            "time_to_first_token_s": None if self.first_token is None else self.first_token - self.arrival,
            "first_token": self.first_token,
            "finished": self.finished,
            "finish_reasons": {str(i): r for i, r in sorted(self.finish_reasons.items())},
            "events": list(self.events),
            "decode": {str(i): _decode_summary(d) for i, d in sorted(self.decodes.items())},
        }


def _decode_summary(d: list[float]) -> dict[str, Any]:
    return {"steps": int(d[0]), "first_step": int(d[1]), "last_step": int(d[2]), "start": d[3], "end": d[4]}


class Inspector:
    """Owned by the engine; ``on_*`` are called from its step path (engine thread only)."""

    def __init__(self, max_steps: int, max_requests: int, block_manager: BlockManager, token_budget: int) -> None:
        assert max_steps > 0 and max_requests > 0
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)
        self.live: dict[str, RequestTimeline] = {}
        self.done: OrderedDict[str, RequestTimeline] = OrderedDict()
        self.max_requests = max_requests
        self.block_manager = block_manager
        self.token_budget = token_budget
        self.experts = ExpertHeatmap()  # a mixture of experts' load over the last steps (``StatsRecorder``)
        self.wall_offset = time.time() - time.monotonic()  # engine times are monotonic

    def wall(self, monotonic: float) -> float:
        return monotonic + self.wall_offset

    # ---- recording (engine thread) ------------------------------------------------
    def on_arrival(
        self, request_id: str, arrival: float, num_prompt_tokens: int, num_seqs: int, constrained: bool = False
    ) -> None:
        tl = RequestTimeline(request_id, self.wall(arrival), num_prompt_tokens, num_seqs, constrained)
        self.live[request_id] = tl

    def on_step(
        self,
        step_id: int,
        start: float,
        duration_s: float,
        sched: SchedulerOutput,
        before: list[tuple[int, int]],
        num_running: int,
        num_waiting: int,
        grammar_s: tuple[float, float] = (0.0, 0.0),
        encoder: tuple[int, float] = (0, 0.0),
    ) -> None:
        """After a successful step: ``before[i]`` is (computed tokens, tokens) of ``sched.seqs[i]``
        when it was scheduled; ``grammar_s`` the step's bitmask (fill, wait) seconds; ``encoder`` its images
        encoded and the encoder's seconds. Sequences that finished in the step are already marked finished."""
        t0, t1 = self.wall(start), self.wall(start + duration_s)
        first_admitted = len(sched.seqs) - sched.num_admitted
        scheduled: list[ScheduledSeq] = []
        admitted: list[tuple[str, int]] = []
        finished: list[tuple[str, int, str]] = []
        for i, (seq, n, (computed, target)) in enumerate(zip(sched.seqs, sched.num_scheduled_tokens, before)):
            tl = self.live.get(seq.request_id)
            scheduled.append(self._scheduled_seq(seq, n, computed, target, i >= first_admitted, tl))
            if i >= first_admitted:
                admitted.append((seq.request_id, seq.index))
            if seq.is_finished:
                finished.append((seq.request_id, seq.index, seq.status.finish_reason or "stop"))
            if tl is not None:
                self._record_seq(tl, scheduled[-1], seq, i >= first_admitted, step_id, t0, t1)
        preempted = tuple((seq.request_id, seq.index) for seq in sched.preempted)
        for request_id, index in preempted:
            tl = self.live.get(request_id)
            if tl is not None:
                tl.add("preempted", t0, step=step_id, seq=index)
        bm = self.block_manager
        self.steps.append(
            StepRecord(
                step_id,
                t0,
                duration_s,
                self.token_budget,
                tuple(scheduled),
                tuple(admitted),
                preempted,
                tuple(finished),
                bm.num_used_blocks,
                bm.num_free_blocks,
                bm.num_cached_free,
                num_running,
                num_waiting,
                *grammar_s,
                *encoder,
            )  # fmt: skip
        )

    def _scheduled_seq(
        self, seq: Sequence, n: int, computed: int, target: int, admitted: bool, tl: RequestTimeline | None
    ) -> ScheduledSeq:
        """What one sequence's ``n`` tokens were: a decode (with drafts verified, or tokens a grammar forced)
        or a prefill chunk (its number, its image tokens)."""
        grammar = seq.matcher is not None
        caught_up = target - computed == 1 and computed >= seq.num_prompt_tokens
        drafted = n - 1 if caught_up and n > 1 and not grammar else 0  # the sample's token + drafts
        accepted = min(drafted, max(0, seq.num_tokens - target - 1)) if drafted else 0
        is_decode = (n == 1 or drafted > 0) and computed >= seq.num_prompt_tokens
        chunk = 0 if is_decode else 1 if admitted else self._next_chunk(tl, seq.index)
        forced = n - 1 if grammar and n > 1 and computed >= seq.num_prompt_tokens else 0  # a sample + forced tokens
        record = ScheduledSeq(seq.request_id, seq.index, n, computed, target, is_decode, chunk, grammar, forced)
        if drafted:
            record = replace(record, drafted=drafted, accepted=accepted)
        if seq.mm_features and not is_decode:
            record = replace(record, **image_share(seq.mm_features, computed, n))
        return record

    def _record_seq(
        self, tl: RequestTimeline, s: ScheduledSeq, seq: Sequence, admitted: bool, step_id: int, t0: float, t1: float
    ) -> None:
        """What one scheduled sequence did in the step, on its request's timeline."""
        if admitted:
            event = "scheduled" if seq.num_preemptions == 0 else "readmitted"
            tl.add(event, t0, step=step_id, seq=seq.index, cached_tokens=s.computed_before)
        if s.is_decode:
            d = tl.decodes.get(seq.index)
            if d is None:
                tl.decodes[seq.index] = [1, step_id, step_id, t0, t1]
            else:
                d[0] += 1
                d[2] = step_id
                d[4] = t1
        else:
            tl.add("prefill", t0, step=step_id, seq=seq.index, tokens=s.num_tokens, chunk=s.chunk, end=t1,
                   computed_after=s.computed_before + s.num_tokens, target=s.target)  # fmt: skip
            # The step that completed the prompt (jump-forward may have appended more than one token since).
            if s.computed_before + s.num_tokens == s.target == seq.num_prompt_tokens:
                if tl.first_token is None:
                    tl.first_token = t1
                tl.add("first_token", t1, step=step_id, seq=seq.index)
        if seq.is_finished:
            self._finish_seq(tl, seq.index, seq.status.finish_reason or "stop", t1, step_id)

    def on_finished_outside_step(self, seqs: Iterable[Sequence], reason: str, step_id: int) -> None:
        """Sequences ended between steps (abort) or by a failed step (error)."""
        now = time.time()
        for seq in seqs:
            tl = self.live.get(seq.request_id)
            if tl is not None and seq.index not in tl.finish_reasons:
                self._finish_seq(tl, seq.index, reason, now, step_id)

    @staticmethod
    def _next_chunk(tl: RequestTimeline | None, index: int) -> int:
        """The chunk number of a running sequence's next prefill piece (1 after a re-admission)."""
        if tl is None:
            return 0
        for e in reversed(tl.events):
            if e.get("seq") == index and e["event"] in ("prefill", "scheduled", "readmitted"):
                return e["chunk"] + 1 if e["event"] == "prefill" else 1
        return 1

    def _finish_seq(self, tl: RequestTimeline, index: int, reason: str, t: float, step_id: int) -> None:
        tl.finish_reasons[index] = reason
        tl.add("finished", t, step=step_id, seq=index, reason=reason)
        if len(tl.finish_reasons) == tl.num_seqs:
            tl.finished = t
            self.live.pop(tl.request_id, None)
            self.done[tl.request_id] = tl
            while len(self.done) > self.max_requests:
                self.done.popitem(last=False)

    # ---- reading (engine thread, through AsyncLLM.inspect) -------------------------
    def timeline(self, request_id: str) -> dict[str, Any] | None:
        tl = self.done.get(request_id) or self.live.get(request_id)
        return None if tl is None else tl.to_dict()

    def recent_steps(self, after_step: int = -1, limit: int = 200) -> list[dict[str, Any]]:
        """Step records newer than ``after_step``, at most the last ``limit``."""
        out = []
        for record in reversed(self.steps):
            if record.step_id <= after_step or len(out) >= limit:
                break
            out.append(record.to_dict())
        return out[::-1]

    def steps_since(self, wall_time: float) -> list[StepRecord]:
        return [r for r in self.steps if r.start + r.duration_s >= wall_time]

    def timelines_since(self, wall_time: float) -> list[RequestTimeline]:
        done = [tl for tl in self.done.values() if tl.finished is not None and tl.finished >= wall_time]
        return done + list(self.live.values())

    def kv_map(self, live: Iterable[Sequence]) -> dict[str, Any]:
        """The KV cache's blocks for the inspector's map (``kv_map.kv_map``)."""
        return kv_map(self.block_manager, live, MAX_KV_CELLS)


def queue_rows(seqs: Iterable[Sequence]) -> list[dict[str, Any]]:
    """The first ``MAX_QUEUE_ROWS`` sequences of a queue, as counts."""
    rows = []
    for seq in seqs:
        if len(rows) == MAX_QUEUE_ROWS:
            break
        rows.append(
            {
                "request_id": seq.request_id,
                "seq": seq.index,
                "prompt_tokens": seq.num_prompt_tokens,
                "output_tokens": seq.num_output_tokens,
                "computed": seq.num_computed_tokens,
                "tokens": seq.num_tokens,
                "blocks": sum(len(t) - t.count(NULL_BLOCK) for t in seq.block_tables),
                "preemptions": seq.num_preemptions,
            }
        )
    return rows
