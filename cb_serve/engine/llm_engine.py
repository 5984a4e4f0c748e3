"""The synchronous engine's public API: add requests, call ``step()`` until they finish. The step
itself is ``EngineCore``'s (token ids); this class's ``step`` then runs the front end's
``OutputProcessor`` on them (text, stop strings, outputs) in the same thread. The parts are made by
``builder.build``."""

from __future__ import annotations

from typing import Any

from cb_serve.config import EngineConfig
from cb_serve.engine.builder import build
from cb_serve.engine.core import EngineCore
from cb_serve.engine.core_output import EngineCoreOutput
from cb_serve.engine.core_request import CoreRequest
from cb_serve.engine.inspector import queue_rows
from cb_serve.engine.output_processor import OutputListener, OutputListeners, OutputProcessor
from cb_serve.engine.processor import ProcessedRequest
from cb_serve.engine.request_state import RequestState
from cb_serve.engine.stats_recorder import StepListener
from cb_serve.engine.trace import trace_events
from cb_serve.errors import InvalidRequestError
from cb_serve.inputs import PromptType
from cb_serve.lora.manager import AdapterKey, adapter_ids, checked
from cb_serve.lora.peft_adapter import LoRAWeights
from cb_serve.lora_request import LoRARequest
from cb_serve.outputs import RequestOutput
from cb_serve.prefix_hash import PrefixDigest
from cb_serve.sampling_params import SamplingParams
from cb_serve.stats import EngineStats

__all__ = ["LLMEngine", "StepListener"]

PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1  # a request's priority: a signed 64-bit int


class LLMEngine(EngineCore):
    """One model on one device (``EngineConfig``). Not thread-safe: drive it from one thread (see AsyncLLM)."""

    def __init__(self, config: EngineConfig) -> None:
        parts = build(config)
        super().__init__(parts)
        setup = parts.setup
        self.device, self.dtype, self.kv_cache_dtype = setup.device, setup.dtype, setup.kv_cache_dtype
        self.hf_config, self.max_model_len = setup.hf_config, setup.max_model_len
        self.backend, self.block_size = setup.backend, setup.block_size
        self.source, self.model_name = setup.source, setup.source.name
        self.tokenizer, self.processor = parts.tokenizer, parts.processor
        self.block_manager, self.lora = parts.block_manager, parts.lora
        self.cpu_kernels = parts.cpu_kernels
        self.output_processor = OutputProcessor()  # the front end, run by ``step`` on this thread
        self.output_listeners = OutputListeners()

    def step(self) -> list[RequestOutput]:
        """Runs one engine step, then makes its outputs: the requests it advanced or ended."""
        outputs, stops, failed = self.output_processor.process_outputs(self.core_step())
        for request_id, index, stop, num_tokens in stops:
            self.stop_sequence(request_id, index, stop, num_tokens)
        for request_id in failed:  # the front end failed them: the engine lets go of them
            self.stats.num_failed_requests += 1
            super().abort_request(request_id)
        if self.output_listeners.listeners:
            for out in outputs:
                self.output_listeners.notify(out.request_id, out)
        return outputs

    def core_step(self) -> list[EngineCoreOutput]:
        """The engine thread's step alone (``EngineCore.step``): its records, no text."""
        return super().step()

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        super().abort_request(ids)
        for request_id in ids:
            if self.output_processor.abort(request_id):
                self.output_listeners.notify(request_id, None)

    @property
    def runner(self):
        """The driver's ``ModelRunner`` (rank 0)."""
        return self.executor.runner

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks (each of ``block_size`` tokens)."""
        return self.block_manager.num_blocks

    @property
    def num_steps(self) -> int:
        return self.stats.num_steps

    @property
    def jump_forward_tokens(self) -> int:
        """Tokens a grammar forced so far (jump-forward), cumulative."""
        return self.structured.jump_forward_tokens

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel workers (ranks 1..N-1; empty without tensor parallelism)."""
        return self.executor.worker_pids

    def dead_workers(self) -> list[int]:
        """Ranks of tensor-parallel workers that have died (safe from any thread)."""
        return self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (nothing else needs stopping; idempotent)."""
        self.executor.shutdown()

    def add_step_listener(self, listener: StepListener) -> None:
        """``listener(stats, outputs)`` runs on the engine's thread after every step, with the
        step's ``StepStats`` and outputs; it must be quick and must not change them. An exception
        in it is logged, never raised. Safe to call from any thread."""
        self.stats.listeners = (*self.stats.listeners, listener)

    def remove_step_listener(self, listener: StepListener) -> None:
        self.stats.listeners = tuple(x for x in self.stats.listeners if x is not listener)

    def add_output_listener(self, listener: OutputListener) -> None:
        """``listener(request_id, output)`` runs where the front end makes each ``RequestOutput`` (this
        class's ``step``; ``AsyncLLM``: the caller's coroutine), and with None when a request ends
        without a finished output: it must be quick. An exception in it is logged, never raised."""
        self.output_listeners.add(listener)

    def remove_output_listener(self, listener: OutputListener) -> None:
        self.output_listeners.remove(listener)

    # ---- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> None:
        """Validates (raising ValueError before anything is scheduled) and queues a request.
        ``priority``: under ``scheduling_policy="priority"``, lower values are scheduled first."""
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        processed = self.processor.process(prompt, params or SamplingParams())
        processed.priority = self.checked_priority(priority)
        processed.lora_request = lora_request
        self.add_processed_request(request_id, processed, arrival_time)

    def add_processed_request(
        self, request_id: str, processed: ProcessedRequest, arrival_time: float | None = None
    ) -> None:
        if arrival_time is not None:
            processed.arrival_time = arrival_time
        state = RequestState(request_id, processed, self.tokenizer, processed.arrival_time)
        self.add_engine_request(request_id, processed)
        self.output_processor.add_request(state)

    def add_engine_request(self, request_id: str, processed: ProcessedRequest) -> None:
        """The engine's part of ``add_processed_request`` (``AsyncLLM``'s engine thread: its front end
        keeps the request's ``RequestState``)."""
        self.check_capacity()  # before an adapter is taken in
        if processed.lora_request is not None:
            weights, processed.lora_weights = processed.lora_weights, None  # handed over: held once, here
            self.add_lora(processed.lora_request, weights)
        faults = frozenset()
        if self.faults is not None:
            faults = self.faults.kinds_for_prompt(processed.prompt or self.tokenizer.decode(processed.prompt_token_ids))
        self.add_core_request(CoreRequest(request_id, processed, processed.arrival_time, faults))

    def checked_priority(self, priority: int) -> int:
        """``priority`` if this engine can honour it, else ``InvalidRequestError`` (param ``priority``):
        an int (not a bool) in the signed 64-bit range, and non-zero only under priority scheduling
        (as vLLM). Safe from any thread."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an int, got {type(priority).__name__}.", "priority")
        if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidRequestError(f"priority {priority} is out of the signed 64-bit range.", "priority")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")
        return int(priority)

    # ---- LoRA adapters --------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest, weights: LoRAWeights | None = None) -> None:
        """Holds an adapter in host memory (vLLM's ``add_lora``; ``weights``: already ``read_lora``),
        checked against the model; raises ``InvalidRequestError`` (param ``lora_request``) when it
        cannot be served."""
        checked(self.lora, lora_request).add(lora_request, self._adapters_in_use, weights)

    def read_lora(self, lora_request: LoRARequest) -> LoRAWeights:
        """The adapter, read and checked off the engine thread (any thread may call this), or the
        engine's own copy if it holds it; ``add_lora`` then takes it without touching the disk.
        Raises ``InvalidRequestError`` as ``add_lora`` does."""
        return checked(self.lora, lora_request).read(lora_request)

    def lora_adapter_ids(self) -> list[int]:
        """``lora_int_id`` of the adapters held (in slots or host memory); safe from any thread."""
        return adapter_ids(self.lora)

    def _adapters_in_use(self) -> set[AdapterKey]:
        return {s.lora.key for state in self.requests.values() for s in state.seqs[:1] if s.lora is not None}

    # ---- observing ------------------------------------------------------------------
    def inspect(self, what: str, **kwargs: Any) -> Any:
        """The inspector's view (None when it is off): ``steps`` (after_step, limit),
        ``timeline`` (request_id), ``state`` (recent steps, KV block map, queues and, for a mixture
        of experts, the layer x expert heat map of the last steps), or
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
                "experts": ins.experts.view(),
            }
        raise ValueError(f"unknown inspector view {what!r}")

    def cache_digest(self) -> PrefixDigest | None:
        """What the prefix cache holds now (a fixed-size Bloom filter), for KV-cache-aware routing."""
        return self.block_manager.digest()

    def get_stats(self) -> EngineStats:
        return self.stats.engine_stats()

    def check_invariants(self) -> None:
        """Asserts the KV cache's invariants over every live sequence (block counts, reference
        counts, hashes): a hook for tests and soak runs, O(blocks)."""
        s = self.scheduler
        self.block_manager.check_invariants([*s.running, *s.waiting, *s.deferred_frees])
