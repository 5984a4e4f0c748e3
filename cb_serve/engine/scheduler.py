"""Iteration-level scheduler: one token budget per step, running sequences first."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from cb_serve.engine.block_manager import BlockManager
from cb_serve.engine.request_queue import make_waiting_queue
from cb_serve.multimodal.features import fit_chunk
from cb_serve.sequence import SchedulerOutput, Sequence, SequenceStatus


class AdmissionGate(Protocol):
    """A capability's say over which waiting sequences may start (``lora.admission.LoRAAdmission``):
    a sequence it holds back waits, holding nothing, and those behind it may go ahead."""

    def begin(self, running: Iterable[Sequence]) -> None: ...
    def may_admit(self, seq: Sequence) -> bool: ...
    def admitted(self, seq: Sequence) -> None: ...


class AdmitAll:
    def begin(self, running: Iterable[Sequence]) -> None:
        pass

    def may_admit(self, seq: Sequence) -> bool:
        return True

    def admitted(self, seq: Sequence) -> None:
        pass


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_partial_prefills: int = 0  # times a prompt got only a chunk of its remaining tokens
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found


class Scheduler:
    """vLLM-v1-style unified scheduling.

    Every sequence has ``num_computed_tokens``; a step gives each scheduled sequence up to
    ``num_tokens - num_computed_tokens`` tokens. Running sequences go first, in admission
    order (a decode needs one token, a partly prefilled prompt gets its next chunk), then
    waiting ones in queue order while budget, ``max_num_seqs`` and KV blocks last. When a
    running sequence needs a block and none is free, a running sequence is preempted: its
    blocks are freed and it is recomputed later (its computed full blocks usually come back
    as prefix-cache hits).

    ``policy`` (as vLLM v1): ``fcfs`` admits in arrival order, preempts the newest running
    sequence and puts it back at the front of the queue; ``priority`` admits in (priority,
    arrival) order, lower values first, and preempts the running sequence with the largest
    (priority, arrival), which goes back into that order (``request_queue``); a victim already
    scheduled this step leaves the step. One difference from vLLM: a sequence that preempts
    itself does not end the step, the (more urgent) running sequences behind it still get their
    tokens (under fcfs none is behind it).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        admission: AdmissionGate | None = None,
        on_release: Callable[[Sequence], None] | None = None,
        policy: str = "fcfs",
    ) -> None:
        """``admission``: which waiting sequences may start (default: all, in queue order);
        ``on_release(seq)``: a sequence's blocks went back (it finished or was preempted);
        ``policy``: "fcfs" or "priority"."""
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"Without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                f"max_model_len ({max_model_len}): a prompt (or a preempted sequence) is computed in one step."
            )
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.admission = admission or AdmitAll()
        self.policy = policy
        self.waiting = make_waiting_queue(policy)
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self.on_release = on_release
        # Async scheduling numbers the steps it launches; a sequence notes its last (``Sequence.last_step``).
        # One that ends while a step computing it is in flight keeps its blocks until that step has completed
        # (``steps_completed``): the step may still write them.
        self.completed_step = 0
        self.deferred_frees: list[Sequence] = []
        self.snapshots = block_manager.snapshots  # a hybrid model's states at block boundaries (prefix caching)
        # which prefill chunks end at (never a prompt computed in one step: chunked prefill off)
        self.aligner = self.snapshots if enable_chunked_prefill else None

    def add(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING and not seq.block_table
        self.waiting.add(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._fit_drafts(budget)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and seq.finishes_when_pending_land(self.max_model_len):
                i += 1  # async scheduling: its token in flight is its last
                continue
            uncomputed = seq.num_uncomputed_tokens
            num_new = min(uncomputed + len(seq.spec_token_ids), budget)
            if seq.mm_features and num_new < uncomputed:  # a chunk never splits an image's tokens
                num_new = fit_chunk(seq.mm_features, seq.num_computed_tokens, num_new)
                if num_new == 0:  # its next image takes more than this step has left
                    i += 1
                    continue
            if self.aligner is not None:  # a hybrid model's prefill ends a chunk where its states are kept
                num_new = self.aligner.align(seq, seq.num_computed_tokens, num_new)
            if seq.spec_token_ids:
                del seq.spec_token_ids[max(0, num_new - uncomputed) :]  # the drafts that fit
            assert num_new > 0, seq
            while not self.block_manager.allocate(seq, num_new):
                if seq.spec_token_ids:  # drafts never cost another sequence its blocks
                    num_new -= len(seq.spec_token_ids)
                    seq.spec_token_ids = []
                    continue
                victim, i, returned = self._evict(i, out)
                budget += returned
                if victim is seq:  # now ``running[i]`` is the next one (fcfs: there is none)
                    break
            else:
                self.counters.num_partial_prefills += num_new < uncomputed
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(num_new)
                budget -= num_new
                i += 1

        if not out.preempted:
            self._admit_waiting(out, budget)
        if self.snapshots is not None:  # the step's state copies: restores for its hits, saves at boundaries
            out.state_copies = self.snapshots.plan_saves(out.seqs, out.num_scheduled_tokens)

        now = time.monotonic()
        for seq in out.seqs:
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
        assert out.total_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_seqs
        return out

    def _fit_drafts(self, budget: int) -> None:
        """Drafts (speculative decoding) only take budget no running sequence's own tokens need:
        they are cut, in admission order, to what is left after every running sequence's tokens."""
        if not any(seq.spec_token_ids for seq in self.running):
            return
        spare = budget - sum(seq.num_uncomputed_tokens for seq in self.running)
        for seq in self.running:
            if seq.spec_token_ids:
                seq.spec_token_ids = seq.spec_token_ids[: max(0, spare)]
                spare -= len(seq.spec_token_ids)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        self.admission.begin(self.running)
        i = 0  # the queue's head, past sequences the admission gate holds back (they wait, holding nothing)
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if seq.num_pending_tokens or not self.admission.may_admit(seq):  # pending: preempted while in flight
                i += 1
                continue
            hit = bm.find_cached_prefix(seq)
            num_computed = hit.num_tokens
            num_new = seq.num_tokens - num_computed
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = fit_chunk(seq.mm_features, num_computed, budget)  # never through an image
                if num_new == 0:
                    break
            if self.aligner is not None:
                num_new = self.aligner.align(seq, num_computed, num_new)
            if not bm.allocate(seq, num_new, hit):
                break  # nobody overtakes the head of the queue (either policy, as vLLM)
            self.counters.num_partial_prefills += num_new < seq.num_tokens - num_computed  # once it is admitted
            del self.waiting[i]
            self.admission.admitted(seq)
            self.counters.prefix_cache_queries += seq.num_tokens
            self.counters.prefix_cache_hits += num_computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(num_new)
            out.num_admitted += 1
            budget -= num_new

    def _evict(self, i: int, out: SchedulerOutput) -> tuple[Sequence, int, int]:
        """Preempts a running sequence for ``self.running[i]``: the newest (fcfs) or the one with the
        largest (priority, arrival), newest among equals (priority). One already scheduled this step
        (before ``i``) leaves the step's output, as in vLLM. Returns the victim, the index of
        ``self.running[i]`` now, and the budget its scheduled tokens gave back."""
        if self.policy == "fcfs":
            v = len(self.running) - 1
        else:
            running = self.running
            v = max(range(len(running)), key=lambda k: (running[k].priority, running[k].times.arrival, k))
        victim = self.running.pop(v)
        returned = 0
        if v < i:  # scheduled this step: out.seqs holds running[:i] in order
            assert out.seqs[v] is victim
            del out.seqs[v]
            returned = out.num_scheduled_tokens.pop(v)
            self.counters.num_partial_prefills -= returned < victim.num_uncomputed_tokens
            i -= 1
        self._preempt(victim)
        out.preempted.append(victim)
        return victim, i, returned

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.prepend(seq)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` of what the step computed: a speculating sequence's drafts
        are not its tokens yet (the output processor counts those the verification accepted)."""
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            seq.num_computed_tokens += n - len(seq.spec_token_ids)
            assert seq.num_computed_tokens <= seq.num_tokens + seq.num_pending_tokens
            self.block_manager.commit_computed(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove ``seq`` (running or waiting) and return its blocks: at once, or when the step in flight
        that computes it has completed (``steps_completed``)."""
        assert status.is_finished
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = status
        seq.times.finished = time.monotonic()
        if seq.last_step > self.completed_step:
            self.deferred_frees.append(seq)
        else:
            self._release(seq)

    def steps_completed(self, step: int) -> None:
        """Every step up to number ``step`` has completed (or failed): sequences that ended while one of
        them was in flight give their blocks back."""
        self.completed_step = max(self.completed_step, step)
        if self.deferred_frees:
            step = self.completed_step
            done = [seq for seq in self.deferred_frees if seq.last_step <= step]
            self.deferred_frees = [seq for seq in self.deferred_frees if seq.last_step > step]
            for seq in done:
                self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.status != SequenceStatus.FINISHED_ERROR:  # its steps have run: what they computed is cached
            self.block_manager.commit_computed(seq)  # (async scheduling: blocks and states its last token ended)
        self.block_manager.free(seq)
        self.block_manager.forget(seq)
        if self.on_release is not None:
            self.on_release(seq)
