"""The synchronous engine: add requests, call ``step()`` until they finish."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from cb_serve.config import EngineConfig
from cb_serve.cpu_ops.kernel_choice import kernel_choice
from cb_serve.distributed.sharding import shard_for
from cb_serve.engine.block_manager import BlockManager
from cb_serve.engine.grammar_admission import GrammarAdmission
from cb_serve.engine.inspector import Inspector, queue_rows
from cb_serve.engine.kv_cache_sizing import kv_cache_bytes_per_block, num_kv_blocks
from cb_serve.engine.processor import InputProcessor
from cb_serve.engine.request_state import RequestState
from cb_serve.engine.scheduler import Scheduler
from cb_serve.engine.trace import trace_events
from cb_serve.errors import (
    EngineFatalError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
    StepFailedError,
)
from cb_serve.executor.worker_pool import WorkerPool
from cb_serve.fault_injection import FaultInjector
from cb_serve.inputs import PromptType
from cb_serve.lora.config import LoRAConfig
from cb_serve.lora.manager import AdapterKey, LoRAManager
from cb_serve.lora.peft_adapter import LoRAAdapterError, LoRAWeights
from cb_serve.lora.request import LoRARequest
from cb_serve.model_executor import loader
from cb_serve.model_executor.cuda_graph import capture_sizes
from cb_serve.model_executor.device_context import device_context
from cb_serve.model_executor.draft_model import DraftModel, DraftModelProposer
from cb_serve.model_executor.model_runner import ModelRunner, StepSample
from cb_serve.model_executor.model_setup import ModelSetup
from cb_serve.outputs import CompletionOutput, RequestOutput
from cb_serve.prefix_hash import PrefixDigest
from cb_serve.sampling_params import SamplingParams
from cb_serve.sequence import SchedulerOutput, Sequence, SequenceStatus
from cb_serve.spec_decode.config import SpeculativeConfig
from cb_serve.spec_decode.speculator import SpecCounters, Speculator
from cb_serve.stats import EngineStats, StepPhases, StepStats
from cb_serve.structured_outputs.jump_forward import JumpForward

logger = logging.getLogger(__name__)

# A step failure fails its requests and the engine goes on; this many in a row mean the
# engine itself is broken (a sticky device error, say), so it stops and the replica is replaced.
MAX_CONSECUTIVE_STEP_FAILURES = 3
MAX_JUMP_TOKENS = 64  # forced tokens appended to one sequence between two steps
GRAMMAR_POLL_S = 0.01  # the longest a step with nothing to run waits for a grammar being compiled

StepListener = Callable[[StepStats, list[RequestOutput]], None]


def waiting_queue_full(num_waiting: int, num_running: int, config: EngineConfig) -> bool:
    """Whether one more request would leave more than ``max_waiting_requests`` requests waiting
    for one of the ``max_num_seqs`` running slots (queued requests fill free slots first)."""
    limit = config.max_waiting_requests
    return limit is not None and num_waiting >= limit + max(0, config.max_num_seqs - num_running)


def per_rank_config(hf_config, tensor_parallel_size: int, device: torch.device):
    """``hf_config`` as one GPU's KV cache sees it under tensor parallelism: the most KV heads any
    rank holds (each rank allocates the same number of blocks, on its own GPU). On CPU the ranks
    share one memory, so the KV-cache size stays the whole model's."""
    if tensor_parallel_size == 1 or device.type != "cuda":
        return hf_config
    ranks = [shard_for(hf_config, r, tensor_parallel_size) for r in range(tensor_parallel_size)]
    rank_config = copy.copy(hf_config)
    rank_config.num_key_value_heads = max(len(r.kv_heads) for r in ranks)
    return rank_config


def eos_token_ids(hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)


def _error_output(state: RequestState, error: Exception) -> RequestOutput:
    """The final output of a request that failed: no text, finish reason ``error``, and ``error``."""
    completions = [CompletionOutput(i, "", [], finish_reason="error") for i in range(len(state.seqs))]
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, True, error=error)


class LLMEngine:
    """One model on one device. Not thread-safe: drive it from one thread (see AsyncLLM)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        setup = ModelSetup.from_config(config)
        self.device, self.dtype, self.kv_cache_dtype = setup.device, setup.dtype, setup.kv_cache_dtype
        self.source, self.hf_config, self.max_model_len = setup.source, setup.hf_config, setup.max_model_len
        self.backend, self.block_size = setup.backend, setup.block_size
        self.tokenizer = loader.load_tokenizer(self.source, config.tokenizer, config.trust_remote_code)
        self.model_name = self.source.name
        spec = SpeculativeConfig.from_dict(config.speculative_config) if config.speculative_config else None
        self.draft: DraftModel | None = None
        if spec is not None and spec.method == "draft_model":
            self.draft = DraftModel.for_target(config, setup, spec.model, self.tokenizer)
        with device_context(self.device):  # load, KV sizing and graph capture on the engine's device
            self.runner = self._make_runner(setup)
        choice = kernel_choice() if self.device.type == "cpu" else None
        self.cpu_kernels = choice.label if choice is not None else ""
        self.block_manager = BlockManager(self.num_blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.max_model_len,
            config.enable_chunked_prefill,
            config.max_loras if config.enable_lora else None,
        )
        self.inspector: Inspector | None = None
        if config.inspector_steps:
            budget = config.max_num_batched_tokens
            self.inspector = Inspector(config.inspector_steps, config.inspector_requests, self.block_manager, budget)
        eos = eos_token_ids(self.hf_config, self.tokenizer)
        self.processor = InputProcessor(self.tokenizer, self.max_model_len, self.hf_config.vocab_size, eos, config)
        self.faults = FaultInjector.from_config(config.fault_injection)
        self.grammars = GrammarAdmission(self.tokenizer, self.hf_config.vocab_size)  # structured outputs
        self.jump = JumpForward(self.hf_config.vocab_size) if config.enable_jump_forward else None
        self.speculator = None if spec is None else self._make_speculator(spec)
        self.spec_seen = SpecCounters()  # the speculator's counters at the last recorded step
        self.jump_forward_since_step = self.jump_forward_tokens = 0
        self.requests: dict[str, RequestState] = {}
        self.step_listeners: tuple[StepListener, ...] = ()
        self.ended_since_step: list[str] = []
        self.constrained_since_step = self.num_constrained_requests = 0  # requests added with a constraint
        self.consecutive_step_failures = 0
        self.num_failed_steps = self.num_failed_requests = self.max_batch_seqs = 0
        self.num_steps = self.prompt_tokens = self.generation_tokens = 0
        self.step_seconds = self.scheduling_seconds = 0.0

    def _make_runner(self, setup: ModelSetup) -> ModelRunner:
        """Loads the model (this rank's shard, with the tensor-parallel workers started beside it),
        sizes the KV cache with the memory the weights left, and captures CUDA graphs."""
        config = self.config
        size = config.tensor_parallel_size
        workers = None
        if size > 1:
            shard_for(self.hf_config, 0, size)  # raises before any worker starts if the heads cannot split
            workers = WorkerPool(config, self.device)
        try:
            tp = workers.group if workers is not None else None
            model = setup.load_model(shard_for(self.hf_config, 0, size), tp)
            self.lora = self._make_lora(model, setup.dtype)  # its slots are allocated before the KV cache is sized
            self.num_blocks = self._num_kv_blocks(setup)
            if workers is not None:
                workers.start(self.num_blocks)
        except BaseException:
            if workers is not None:
                workers.shutdown()
            raise
        graph_sizes = self._graph_sizes()
        runner = ModelRunner(
            model,
            self.num_blocks,
            self.block_size,
            self.kv_cache_dtype,
            self.device,
            graph_sizes,
            self.max_model_len,
            workers,
        )
        runner.lora_batch = None if self.lora is None else self.lora.batch
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv cache %s backend=%s blocks=%d x %d tokens, cuda graphs %s, "
            "tensor parallel %d",
            self.model_name,
            self.device,
            self.dtype,
            self.kv_cache_dtype,
            self.backend.name,
            self.num_blocks,
            self.block_size,
            graph_sizes and f"{len(graph_sizes)} sizes up to {graph_sizes[-1]}",
            size,
        )
        return runner

    def _make_lora(self, model: torch.nn.Module, dtype: torch.dtype) -> LoRAManager | None:
        config = self.config
        if not config.enable_lora:
            return None
        return LoRAManager(model, LoRAConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras), dtype)

    def _num_kv_blocks(self, setup: ModelSetup) -> int:
        """KV blocks in the memory the weights left (a draft model's weights loaded first, and its
        cache, as many blocks as the target's, counted in)."""
        s, draft = setup, self.draft
        if draft is not None:
            draft.load()  # before the KV cache is sized: its weights and its cache share the memory
        rank_config = per_rank_config(s.hf_config, self.config.tensor_parallel_size, s.device)
        d = draft and draft.setup
        mirror = 0 if d is None else kv_cache_bytes_per_block(d.hf_config, d.block_size, d.kv_cache_dtype)
        return num_kv_blocks(
            self.config, rank_config, s.block_size, s.max_model_len, s.kv_cache_dtype, s.dtype, s.device, mirror
        )

    def _graph_sizes(self) -> list[int] | None:
        """Decode batch sizes to capture CUDA graphs for (None: eager). Graphs are captured by one
        process; tensor-parallel ranks run eagerly (see the README), and so do adapters (their
        token groups change every step)."""
        config = self.config
        graphable = config.tensor_parallel_size == 1 and self.lora is None and not config.enforce_eager
        if self.device.type == "cuda" and self.backend.supports_cuda_graphs and graphable:
            return capture_sizes(config.max_num_seqs)
        return None

    def _make_speculator(self, spec: SpeculativeConfig) -> Speculator:
        """The speculator; with a draft model, its proposer has a KV cache of its own with as many
        blocks as the target's (sized together, ``_make_runner``)."""
        budget = self.config.max_num_batched_tokens
        proposer = None
        if self.draft is not None:
            blocks = BlockManager(self.num_blocks, self.block_size, enable_prefix_caching=False)
            with device_context(self.device):
                proposer = DraftModelProposer(self.draft.runner(self.num_blocks), blocks, budget)
        speculator = Speculator(spec, self.max_model_len, budget, proposer)
        self.scheduler.on_release = speculator.release  # a proposer's per-sequence state goes with its blocks
        return speculator

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel workers (ranks 1..N-1; empty without tensor parallelism)."""
        workers = self.runner.workers
        return list(workers.pids) if workers is not None else []

    def dead_workers(self) -> list[int]:
        """Ranks of tensor-parallel workers that have died (safe from any thread)."""
        workers = self.runner.workers
        return workers.dead_workers() if workers is not None else []

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (nothing else needs stopping; idempotent)."""
        self.runner.shutdown()

    def add_step_listener(self, listener: StepListener) -> None:
        """``listener(stats, outputs)`` runs on the engine's thread after every step, with the
        step's ``StepStats`` and outputs; it must be quick and must not change them. An exception
        in it is logged, never raised. Safe to call from any thread."""
        self.step_listeners = (*self.step_listeners, listener)

    def remove_step_listener(self, listener: StepListener) -> None:
        self.step_listeners = tuple(x for x in self.step_listeners if x is not listener)

    # ---- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates (raising ValueError before anything is scheduled) and queues a request."""
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        processed = self.processor.process(prompt, params or SamplingParams())
        processed.lora_request = lora_request
        self.add_processed_request(request_id, processed, arrival_time)

    def add_processed_request(self, request_id: str, processed, arrival_time: float | None = None) -> None:
        if waiting_queue_full(len(self.scheduler.waiting), len(self.scheduler.running), self.config):
            limit = self.config.max_waiting_requests
            raise EngineOverloadedError(f"The engine's waiting queue is full ({limit} requests).")
        if processed.lora_request is not None:
            weights, processed.lora_weights = processed.lora_weights, None  # handed over: held once, here
            self.add_lora(processed.lora_request, weights)
        faults = frozenset()
        if self.faults is not None:
            faults = self.faults.kinds_for_prompt(processed.prompt or self.tokenizer.decode(processed.prompt_token_ids))
        state = RequestState(request_id, processed, self.tokenizer, arrival_time or time.monotonic(), faults)
        self.requests[request_id] = state
        constrained = processed.params.structured_outputs is not None
        if self.inspector is not None:
            arrival, num_prompt_tokens = state.seqs[0].times.arrival, len(processed.prompt_token_ids)
            self.inspector.on_arrival(request_id, arrival, num_prompt_tokens, len(state.seqs), constrained)
        if constrained:
            self.num_constrained_requests += 1
            self.constrained_since_step += 1
            self.grammars.add(state)  # scheduled once its grammar is compiled (off this thread)
            return
        for seq in state.seqs:
            self.scheduler.add(seq)

    # ---- LoRA adapters --------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest, weights: LoRAWeights | None = None) -> None:
        """Holds an adapter in host memory (vLLM's ``add_lora``; ``weights``: already ``read_lora``),
        checked against the model; raises ``InvalidRequestError`` (param ``lora_request``) when it
        cannot be served."""
        self._check_lora(lora_request)
        try:
            self.lora.add(lora_request, self._adapters_in_use, weights)
        except LoRAAdapterError as e:
            raise InvalidRequestError(str(e), "lora_request") from e

    def read_lora(self, lora_request: LoRARequest) -> LoRAWeights:
        """The adapter, read and checked off the engine thread (any thread may call this), or the
        engine's own copy if it holds it; ``add_lora`` then takes it without touching the disk.
        Raises ``InvalidRequestError`` as ``add_lora`` does."""
        self._check_lora(lora_request)
        held = self.lora.held(lora_request.key)
        if held is not None:
            return held
        try:
            return self.lora.read(lora_request)
        except LoRAAdapterError as e:
            raise InvalidRequestError(str(e), "lora_request") from e

    def lora_adapter_ids(self) -> list[int]:
        """``lora_int_id`` of the adapters held (in slots or host memory); safe from any thread."""
        return [] if self.lora is None else self.lora.adapter_ids()

    def _check_lora(self, lora_request: LoRARequest) -> None:
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters are not enabled on this engine (enable_lora).", "lora_request")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"Expected a LoRARequest, got {type(lora_request).__name__}.", "lora_request")

    def remove_lora(self, lora_name: str) -> bool:
        """Drops an idle adapter from host memory (one still in use stays until its requests end)."""
        return self.lora is not None and self.lora.remove(lora_name, self._adapters_in_use) > 0

    def _adapters_in_use(self) -> set[AdapterKey]:
        return {s.lora.key for state in self.requests.values() for s in state.seqs[:1] if s.lora is not None}

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            self._end_outside_step(state.seqs, SequenceStatus.FINISHED_ABORTED)
            self._note_ended(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of the requests it advanced.

        Failures are contained: an exception while one request's output is processed fails
        that request alone (``RequestFailedError``); any other exception of the step fails the
        step's requests (``StepFailedError``, retryable) and frees their KV blocks. Only
        ``EngineFatalError`` escapes, also raised after ``MAX_CONSECUTIVE_STEP_FAILURES``
        failed steps in a row."""
        start = time.monotonic()
        refused = [self._refuse(r, e) for r, e in self.grammars.admit(self.scheduler)]
        if self.speculator is not None:
            with device_context(self.device):  # a draft model's passes launch kernels on the engine's device
                self.speculator.propose(self.scheduler.running)  # drafts ride along in the ragged batch
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if not refused:
                self.grammars.wait(GRAMMAR_POLL_S)  # nothing to run until a grammar is compiled
            return refused
        scheduled = time.monotonic()
        before = None if self.inspector is None else [(s.num_computed_tokens, s.num_tokens) for s in sched.seqs]
        num_decode_tokens = sum(  # output tokens fed back one at a time (not a prompt's last chunk), with drafts
            n
            for seq, n in zip(sched.seqs, sched.num_scheduled_tokens)
            if n - len(seq.spec_token_ids) == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        )
        try:
            if self.faults is not None:
                kinds = {k for seq in sched.seqs for k in self.requests[seq.request_id].faults}
                self.faults.before_step(self.num_steps + self.num_failed_steps + 1, kinds)
            if self.lora is not None:
                self.lora.assign_slots(self.scheduler.running)  # LoRA adapters join the step here
            with device_context(self.device):  # Triton launches on the calling thread's current device
                inp = self.runner.prepare(sched)
                prepared = time.monotonic()
                sampled = self.runner.execute(inp)
            self.scheduler.update_after_step(sched)
        except EngineFatalError:
            raise
        except Exception as e:  # noqa: BLE001 - contained: the step's requests fail, the engine goes on
            return refused + self._fail_step(sched, e)
        self.consecutive_step_failures = 0
        now = time.monotonic()
        changed, failed = self._append_sampled(inp.sampling_seqs, sampled, now)
        outputs = refused + self._make_outputs(changed, failed)
        phases = StepPhases(scheduled - start, prepared - scheduled, now - prepared, time.monotonic() - now)
        self._record_step(sched, num_decode_tokens, phases, outputs)
        if self.inspector is not None:
            s, g = self.scheduler, self.runner.last_grammar_timing
            running, waiting, grammar_s = len(s.running), len(s.waiting), (g.fill_s, g.wait_s)
            self.inspector.on_step(self.num_steps, start, phases.total_s, sched, before, running, waiting, grammar_s)
        return outputs

    def _append_sampled(
        self, seqs: list[Sequence], sampled: StepSample | None, now: float
    ) -> tuple[dict[str, set[int]], dict[str, BaseException]]:
        """Appends each sampled token (a speculating sequence's accepted drafts and the target's
        token after them): which completions of which requests changed, and which requests failed
        on the way."""
        changed: dict[str, set[int]] = {}
        failed: dict[str, BaseException] = {}
        if sampled is None:
            return changed, failed
        for seq, emitted, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs):
            if seq.request_id in failed:
                continue
            try:
                self._append_emitted(seq, emitted, logprobs, now)
                if logprobs[-1] is None:  # forced tokens have no logprobs of their own
                    self._jump_forward(seq, now)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                failed[seq.request_id] = e
            finally:
                seq.spec_token_ids = []
            changed.setdefault(seq.request_id, set()).add(seq.index)
        return changed, failed

    def _append_emitted(self, seq: Sequence, emitted: list[int], logprobs: list, now: float) -> None:
        """The sampled token; after drafts, the accepted ones and the target's token after them, each
        draft's KV counted as computed once it is accepted. A stop among them ends the sequence there."""
        if seq.spec_token_ids:
            self.speculator.record(seq, len(seq.spec_token_ids), len(emitted))
        for i, token_id in enumerate(emitted):
            if i:  # the previous token was an accepted draft: this step wrote its KV
                seq.num_computed_tokens += 1
            self._append_token(seq, token_id, logprobs[i], now)
            if seq.is_finished:
                return
        if len(emitted) > 1:
            self.block_manager.commit_computed(seq)  # blocks the accepted drafts filled

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
        for request_id, e in failed.items():
            logger.error("request %s failed while its output was processed", request_id, exc_info=e)
            outputs.append(self._fail_request(request_id, RequestFailedError("This request failed on the server.")))
        return outputs

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        self.num_failed_steps += 1
        self.consecutive_step_failures += 1
        request_ids = list(dict.fromkeys(seq.request_id for seq in sched.seqs))
        logger.error("engine step failed; failing its %d request(s) %s", len(request_ids), request_ids, exc_info=error)
        if self.consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineFatalError(f"{self.consecutive_step_failures} engine steps failed in a row") from error
        message = "The engine step running this request failed; retry the request."
        outputs = []
        for request_id in request_ids:
            if request_id in self.requests:
                self._note_ended(self.requests[request_id])  # observers see no step with its output
                outputs.append(self._fail_request(request_id, StepFailedError(message)))
        return outputs

    def _note_ended(self, state: RequestState) -> None:
        """Names a request that ended with no finished output passed to the step listeners in
        the next step's ``StepStats.ended_request_ids`` if it ran (observers may hold its state)."""
        if any(seq.times.first_token is not None for seq in state.seqs):
            self.ended_since_step.append(state.request_id)

    def _fail_request(self, request_id: str, error: RequestFailedError | StepFailedError) -> RequestOutput:
        """Ends every sequence of the request (freeing its KV blocks); its final output carries ``error``."""
        self.num_failed_requests += 1
        state = self.requests.pop(request_id)
        self._end_outside_step(state.seqs, SequenceStatus.FINISHED_ERROR)
        return _error_output(state, error)

    def _refuse(self, request_id: str, error: Exception) -> RequestOutput:
        """Ends a request whose constraint could not be compiled: its final output carries ``error``
        (a 400, or a 503 when the compiler was too busy for its client), and nothing of it was ever scheduled."""
        state = self.requests.pop(request_id)
        self._end_unscheduled(state.seqs, SequenceStatus.FINISHED_ERROR)
        return _error_output(state, error)

    def _end_unscheduled(self, seqs: list[Sequence], status: SequenceStatus) -> None:
        for seq in seqs:
            seq.status = status
        if self.inspector is not None:
            self.inspector.on_finished_outside_step(seqs, status.finish_reason, self.num_steps)

    def _end_outside_step(self, seqs: list[Sequence], status: SequenceStatus) -> None:
        """Ends the unfinished ``seqs`` (abort, or a failure), freeing their KV blocks."""
        unfinished = [seq for seq in seqs if not seq.is_finished]
        if unfinished and self.grammars.drop(unfinished[0].request_id):  # never scheduled: nothing to free
            self._end_unscheduled(unfinished, status)
            return
        for seq in unfinished:
            self.scheduler.finish(seq, status)
        if self.inspector is not None:
            self.inspector.on_finished_outside_step(unfinished, status.finish_reason, self.num_steps)

    def _append_token(
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
        if seq.matcher is not None and not seq.matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its mask allowed")
        at_limit = seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len
        decision = state.stop_checker.update(token_id, seq.num_output_tokens, at_limit, state.detokenizers[seq.index])
        if decision is None and seq.matcher is not None and seq.matcher.is_terminated:
            decision = ("stop", None)  # the grammar is complete
        if decision is not None:
            reason, seq.stop_reason = decision
            status = SequenceStatus.FINISHED_STOPPED if reason == "stop" else SequenceStatus.FINISHED_LENGTH
            self.scheduler.finish(seq, status)

    def _jump_forward(self, seq: Sequence, now: float) -> None:
        """Appends the tokens the grammar forces next, each the only one its mask admits
        (``JumpForward``): they join the sequence's next step as a chunk, with no step of their own."""
        jump = self.jump
        if jump is None or seq.matcher is None or seq.is_finished:
            return
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens, MAX_JUMP_TOKENS)
        for token_id in jump.candidates(seq.matcher, room):
            if not jump.is_only_choice(seq.matcher, token_id):
                break
            self._append_token(seq, token_id, None, now, forced=True)
            self.jump_forward_since_step += 1
            if seq.is_finished:
                break

    def _record_step(
        self, sched: SchedulerOutput, num_decode_tokens: int, phases: StepPhases, outputs: list[RequestOutput]
    ) -> None:
        self.num_steps += 1
        self.step_seconds += phases.total_s
        if self.speculator is not None and num_decode_tokens == sched.total_tokens:
            self.speculator.observe_step(sched.total_tokens, phases.total_s)
        self.scheduling_seconds += phases.schedule_s + phases.prepare_s
        grammar = self.runner.last_grammar_timing
        stats = StepStats(
            num_seqs=len(sched.seqs),
            num_decode_tokens=num_decode_tokens,
            num_prefill_tokens=sched.total_tokens - num_decode_tokens,
            num_scheduled_tokens=sched.total_tokens,
            token_budget=self.scheduler.max_num_batched_tokens,
            num_preempted=len(sched.preempted),
            duration_s=phases.total_s,
            phases=phases,
            ended_request_ids=tuple(self.ended_since_step),
            num_constrained_seqs=grammar.num_seqs,
            grammar_fill_s=grammar.fill_s,
            grammar_wait_s=grammar.wait_s,
            grammar_compile_s=self.grammars.drain_compile_times(),
            num_constrained_requests=self.constrained_since_step,
            jump_forward_tokens=self.jump_forward_since_step,
            **self._spec_since_step(),
        )
        self.ended_since_step.clear()
        self.jump_forward_tokens += self.jump_forward_since_step
        self.constrained_since_step = self.jump_forward_since_step = 0
        self.max_batch_seqs = max(self.max_batch_seqs, stats.num_seqs)
        for listener in self.step_listeners:
            try:
                listener(stats, outputs)
            except Exception:  # noqa: BLE001 - an observer must not stop the engine
                logger.exception("step listener %r failed", listener)

    def _spec_since_step(self) -> dict[str, Any]:
        """The speculator's counts since the last recorded step (``StepStats`` fields)."""
        if self.speculator is None:
            return {}
        now, seen = self.speculator.counters, self.spec_seen
        self.spec_seen = dataclasses.replace(now, accepted_per_pos=list(now.accepted_per_pos))
        per_pos = tuple(
            a - b for a, b in zip(now.accepted_per_pos, seen.accepted_per_pos or [0] * len(now.accepted_per_pos))
        )
        return {
            "num_drafts": now.num_drafts - seen.num_drafts,
            "num_draft_tokens": now.num_draft_tokens - seen.num_draft_tokens,
            "num_accepted_tokens": now.num_accepted_tokens - seen.num_accepted_tokens,
            "num_accepted_tokens_per_pos": per_pos,
        }

    def inspect(self, what: str, **kwargs: Any) -> Any:
        """The inspector's view (None when it is off): ``steps`` (after_step, limit),
        ``timeline`` (request_id), ``state`` (recent steps, KV block map and queues), or
        ``trace`` (since: wall-clock seconds; see ``cb_serve.trace``)."""
        ins = self.inspector
        if ins is None:
            return None
        if what == "steps":
            return ins.recent_steps(**kwargs)
        if what == "timeline":
            return ins.timeline(**kwargs)
        if what == "trace":  # kwargs: since, pid, name
            return trace_events(ins.steps_since(kwargs["since"]), ins.timelines_since(kwargs["since"]), **kwargs)
        if what == "state":
            s = self.scheduler
            return {
                "steps": ins.recent_steps(**kwargs),
                "kv": ins.kv_map([*s.running, *s.waiting]),
                "running": queue_rows(s.running),
                "waiting": queue_rows(s.waiting),
                "num_running": len(s.running),
                "num_waiting": len(s.waiting),
                "token_budget": s.max_num_batched_tokens,
                "max_num_seqs": s.max_num_seqs,
            }
        raise ValueError(f"unknown inspector view {what!r}")

    def cache_digest(self) -> PrefixDigest | None:
        """What the prefix cache holds now (a fixed-size Bloom filter), for KV-cache-aware routing."""
        return self.block_manager.digest()

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        compiling = list(self.grammars.waiting_seqs())  # waiting, as vLLM counts them (see EngineStats)
        waiting_tokens = sum(seq.num_uncomputed_tokens for seq in [*s.waiting, *compiling])
        waiting_tokens += sum(seq.num_uncomputed_tokens for seq in s.running if seq.num_uncomputed_tokens > 1)
        running_requests = {seq.request_id for seq in s.running}
        waiting_requests = {seq.request_id for seq in s.waiting} - running_requests
        num_waiting_grammar = len(self.grammars.waiting)
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(compiling),
            num_waiting_tokens=waiting_tokens,
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            num_preemptions=s.counters.num_preemptions,
            num_partial_prefills=s.counters.num_partial_prefills,
            prefix_cache_queries=s.counters.prefix_cache_queries,
            prefix_cache_hits=s.counters.prefix_cache_hits,
            num_steps=self.num_steps,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            step_seconds=self.step_seconds,
            scheduling_seconds=self.scheduling_seconds,
            num_failed_steps=self.num_failed_steps,
            num_failed_requests=self.num_failed_requests,
            max_batch_seqs=self.max_batch_seqs,
            num_requests_running=len(running_requests),
            num_requests_waiting=len(waiting_requests) + num_waiting_grammar,
            num_requests_waiting_grammar=num_waiting_grammar,
            num_constrained_requests=self.num_constrained_requests,
            cpu_kernels=self.cpu_kernels,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, int]:
        lora = self.lora
        if lora is None:
            return {}
        return {
            "lora_slots_used": lora.num_slots_used,
            "max_loras": lora.config.max_loras,
            "lora_loads": lora.counters.num_loads,
            "lora_evictions": lora.counters.num_evictions,
            "lora_adapters_loaded": len(lora.loaded),
        }
