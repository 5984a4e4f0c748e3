"""Assembles each step's ``StepStats`` (one nested stats object per capability, each taken from its
owner with ``take_stats()``: the one per-step delta idiom), tells the step listeners and the
inspector, and answers ``EngineStats``."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cb_serve.engine.core_output import EngineCoreOutput
from cb_serve.engine.core_request import CoreRequest
from cb_serve.engine.inspector import Inspector
from cb_serve.engine.scheduler import Scheduler
from cb_serve.engine.token_updater import TokenUpdater
from cb_serve.lora.manager import LoRAManager, lora_stats
from cb_serve.model_executor.jit_compiles import num_triton_compiles
from cb_serve.model_executor.step_output import StepResult
from cb_serve.multimodal.encoder_cache import EncoderCache
from cb_serve.sequence import SchedulerOutput
from cb_serve.spec_decode.speculator import NoSpeculation, Speculator
from cb_serve.stats import EngineStats, MultiModalStats, StepPhases, StepStats
from cb_serve.structured_outputs.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

StepListener = Callable[[StepStats, list[EngineCoreOutput]], None]  # the step's records (token ids)


@dataclass
class StepInProgress:
    """What a step's stats need from before it ran."""

    start: float
    scheduled: float
    num_decode_tokens: int  # output tokens fed back one at a time (not a prompt's last chunk), with drafts
    before: list[tuple[int, int]] | None  # each sequence's (computed, tokens) for the inspector
    executed: float = 0.0  # when the executor was done


class StatsRecorder:
    def __init__(
        self,
        scheduler: Scheduler,
        outputs: TokenUpdater,
        structured: StructuredOutputManager,
        speculator: Speculator | NoSpeculation,
        lora: LoRAManager | None,
        inspector: Inspector | None,
        cpu_kernels: str,
        weight_bytes: dict[str, int],
        encoder_cache: EncoderCache | None = None,
    ) -> None:
        self.scheduler, self.outputs, self.structured = scheduler, outputs, structured
        self.encoder_cache = encoder_cache  # a model that reads images: its encoder outputs
        self.speculator, self.lora, self.inspector, self.cpu_kernels = speculator, lora, inspector, cpu_kernels
        self.weight_bytes = weight_bytes
        self.listeners: tuple[StepListener, ...] = ()
        self.ended_since_step: list[str] = []
        self.request_images: list[int] = []  # a model that reads images: each request added since the last step
        self.num_steps = self.num_failed_steps = self.num_failed_requests = self.max_batch_seqs = 0
        self.step_seconds = self.scheduling_seconds = 0.0

    def begin(self, start: float, sched: SchedulerOutput) -> StepInProgress:
        before = None if self.inspector is None else [(s.num_computed_tokens, s.num_tokens) for s in sched.seqs]
        num_decode_tokens = sum(
            n
            for seq, n in zip(sched.seqs, sched.num_scheduled_tokens)
            if n - len(seq.spec_token_ids) == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        )
        return StepInProgress(start, time.monotonic(), num_decode_tokens, before)

    def note_added(self, state: CoreRequest) -> None:
        """Counts a new request's images (a model that reads them) for the next step's ``request_images``."""
        if self.encoder_cache is not None:
            self.request_images.append(len(state.seqs[0].mm_features))

    def take_multimodal(self) -> MultiModalStats:
        """The encoder's work since the previous step (under async scheduling, the step launched meanwhile
        too), and the images of each request added since."""
        if self.encoder_cache is None:
            return MultiModalStats()
        stats = self.encoder_cache.take_stats()
        stats.request_images, self.request_images = tuple(self.request_images), []
        return stats

    def note_ended(self, state: CoreRequest) -> None:
        """Names a request that ended with no finished output passed to the step listeners in
        the next step's ``StepStats.ended_request_ids`` if it ran (observers may hold its state)."""
        if any(seq.times.first_token is not None for seq in state.seqs):
            self.ended_since_step.append(state.request_id)

    def record(self, step: StepInProgress, sched: SchedulerOutput, result: StepResult, outputs: list) -> None:
        now = time.monotonic()
        execute_s = step.executed - step.scheduled - result.prepare_s
        phases = StepPhases(step.scheduled - step.start, result.prepare_s, execute_s, now - step.executed)
        self.num_steps += 1
        self.step_seconds += phases.total_s
        self.scheduling_seconds += phases.schedule_s + phases.prepare_s
        if step.num_decode_tokens == sched.total_tokens:  # speculation's cost curve is of decode steps
            self.speculator.observe_step(sched.total_tokens, phases.total_s)
        stats = StepStats(
            num_seqs=len(sched.seqs),
            num_decode_tokens=step.num_decode_tokens,
            num_prefill_tokens=sched.total_tokens - step.num_decode_tokens,
            num_scheduled_tokens=sched.total_tokens,
            token_budget=self.scheduler.max_num_batched_tokens,
            num_preempted=len(sched.preempted),
            duration_s=phases.total_s,
            phases=phases,
            ended_request_ids=tuple(self.ended_since_step),
            structured_output=self.structured.take_stats(),
            spec_decoding=self.speculator.take_stats(),
            expert_load=result.expert_load,
            multimodal=self.take_multimodal(),
        )
        self.ended_since_step.clear()
        self.max_batch_seqs = max(self.max_batch_seqs, stats.num_seqs)
        for listener in self.listeners:
            try:
                listener(stats, outputs)
            except Exception:  # noqa: BLE001 - an observer must not stop the engine
                logger.exception("step listener %r failed", listener)
        if self.inspector is not None:
            s, grammar_s = self.scheduler, (stats.grammar_fill_s, stats.grammar_wait_s)
            encoder = (stats.num_images_encoded, stats.encoder_s)
            args = (sched, step.before, len(s.running), len(s.waiting), grammar_s, encoder)
            self.inspector.on_step(self.num_steps, step.start, phases.total_s, *args)
            self.inspector.experts.add(self.num_steps, result.expert_load)  # a mixture of experts' routing

    def engine_stats(self) -> EngineStats:
        s, out = self.scheduler, self.outputs
        compiling = list(self.structured.waiting_seqs())  # waiting, as vLLM counts them (see EngineStats)
        waiting_tokens = sum(seq.num_uncomputed_tokens for seq in [*s.waiting, *compiling])
        waiting_tokens += sum(seq.num_uncomputed_tokens for seq in s.running if seq.num_uncomputed_tokens > 1)
        running_requests = {seq.request_id for seq in s.running}
        waiting_requests = {seq.request_id for seq in s.waiting} - running_requests
        num_waiting_grammar = len(self.structured.waiting)
        lora = dataclasses.asdict(lora_stats(self.lora))
        slots, snapshots = s.block_manager.state_slots, s.block_manager.snapshots
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(compiling),
            num_waiting_tokens=waiting_tokens,
            kv_blocks_used=s.block_manager.num_used_blocks,
            kv_blocks_total=s.block_manager.num_blocks,
            state_slots_used=slots.num_used if slots else 0,
            state_slots_total=slots.num_slots if slots else 0,
            state_snapshots_used=snapshots.num_used if snapshots else 0,
            state_snapshots_total=snapshots.num_snapshots if snapshots else 0,
            num_preemptions=s.counters.num_preemptions,
            num_partial_prefills=s.counters.num_partial_prefills,
            prefix_cache_queries=s.counters.prefix_cache_queries,
            prefix_cache_hits=s.counters.prefix_cache_hits,
            num_steps=self.num_steps,
            prompt_tokens=out.prompt_tokens,
            generation_tokens=out.generation_tokens,
            step_seconds=self.step_seconds,
            scheduling_seconds=self.scheduling_seconds,
            num_failed_steps=self.num_failed_steps,
            num_failed_requests=self.num_failed_requests,
            max_batch_seqs=self.max_batch_seqs,
            num_requests_running=len(running_requests),
            num_requests_waiting=len(waiting_requests) + num_waiting_grammar,
            num_requests_waiting_grammar=num_waiting_grammar,
            num_constrained_requests=self.structured.num_constrained_requests,
            cpu_kernels=self.cpu_kernels,
            weight_bytes=self.weight_bytes,
            num_triton_compiles=0 if self.cpu_kernels else num_triton_compiles(),
            **lora,
            **encoder_stats(self.encoder_cache),
        )


def encoder_stats(cache: EncoderCache | None) -> dict[str, int]:
    """The images encoded, those taken from the encoder cache instead, and the embeddings it holds."""
    if cache is None:
        return {}
    return {"num_images_encoded": cache.num_encoded, "encoder_cache_hits": cache.num_hits,
            "encoder_cache_embeddings": cache.size}  # fmt: skip
