"""Engine statistics the serving layer exports (metrics, routing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepPhases:
    """Wall seconds of one step's phases, in order."""

    schedule_s: float = 0.0  # the scheduler's decisions
    prepare_s: float = 0.0  # building the batch's tensors (input ids, positions, block tables)
    execute_s: float = 0.0  # the model forward, logits and sampling
    output_s: float = 0.0  # appending tokens, the stops that need no text, making the records (text: the front end)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.execute_s + self.output_s


class _Nested:
    """A field of a capability's stats object, read and written through its parent's attribute."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __set_name__(self, cls: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.owner), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.owner), self.name, value)


@dataclass
class StructuredOutputStats:
    """One step's structured outputs (``StructuredOutputManager.take_stats``)."""

    num_constrained_seqs: int = 0  # sampling sequences of this step that carry a grammar matcher
    grammar_fill_s: float = 0.0  # the bitmask filler thread's wall seconds on this step's masks (0: none)
    grammar_wait_s: float = 0.0  # sampling's wall seconds waiting for those masks after the forward
    # Since the previous step: the seconds of the grammar compiles that completed, the requests
    # added with a constraint, and the tokens a grammar forced (jump-forward: no forward pass of their own).
    grammar_compile_s: tuple[float, ...] = ()
    num_constrained_requests: int = 0
    jump_forward_tokens: int = 0


@dataclass
class SpecDecodingStats:
    """One step's speculative decoding (``Speculator.take_stats``), as vLLM's ``spec_decode`` metrics count."""

    num_drafts: int = 0  # sequences whose drafts this step verified
    num_draft_tokens: int = 0  # their drafts
    num_accepted_tokens: int = 0  # of those, drafts the target agreed with (emitted beside its own token)
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: drafts accepted at draft position i

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verified sequence-step: ``num_drafts`` drafted, ``num_accepted`` of them accepted
        (``num_accepted_tokens_per_pos`` starts as zeros, one per draft position)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = list(self.num_accepted_tokens_per_pos)
        for i in range(num_accepted):
            per_pos[i] += 1
        self.num_accepted_tokens_per_pos = tuple(per_pos)


@dataclass
class MultiModalStats:
    """One step's images (a model that reads them): those it ran through the vision encoder and the host wall
    seconds of those calls (on a GPU, their launches) (``EncoderCache.take_stats``); and the image count of
    each request added since the previous step."""

    num_images_encoded: int = 0
    encoder_s: float = 0.0
    request_images: tuple[int, ...] = ()


@dataclass
class LoRAStats:
    """The adapters (``LoRAManager.stats``): in device slots now, of ``max_loras``; cumulative slot
    loads (an adapter copied into a slot) and evictions (one displaced by another); held in host memory."""

    lora_slots_used: int = 0
    max_loras: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    lora_adapters_loaded: int = 0


@dataclass(frozen=True)
class ExpertLoad:
    """One step's mixture-of-experts routing, read from the driver's model (``ModelRunner``):
    ``counts[i, e]`` is how many of the step's tokens the router of decoder layer ``layers[i]`` sent
    to expert ``e``. Every token goes to ``top_k`` experts of each MoE layer, so a row sums to the
    tokens the forward pass computed times ``top_k`` (a CUDA-graph decode step's padding rows included:
    the experts run them too)."""

    layers: tuple[int, ...]  # the model's MoE layers (decoder layer indices), in order
    counts: Any  # numpy int64 [len(layers), num_experts]

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def imbalance(self) -> float:
        """How much longer the step's expert work is than a perfectly balanced one, where each layer
        waits for its busiest expert (under expert parallelism, the rank holding it): the busiest
        expert's tokens summed over the layers over the mean per expert summed over the layers. 1:
        balanced; at most ``num_experts`` (every token on one expert); a batch of fewer than
        ``num_experts / top_k`` tokens cannot be balanced."""
        total = int(self.counts.sum())
        return float(self.counts.max(axis=1).sum()) * self.num_experts / total if total else 0.0


@dataclass
class StepStats:
    """One engine step: what it computed and how full the token budget was."""

    num_seqs: int
    num_decode_tokens: int  # output tokens fed back one per sequence (decodes)
    num_prefill_tokens: int  # tokens of prompt chunks / recomputation
    num_scheduled_tokens: int
    token_budget: int
    num_preempted: int
    duration_s: float
    phases: StepPhases = StepPhases()
    # Requests that ended since the previous step after they had produced a token, with no
    # finished output passed to the step listeners (aborted, or failed with their step): an
    # observer that keeps per-request state forgets them.
    ended_request_ids: tuple[str, ...] = ()
    structured_output: StructuredOutputStats = field(default_factory=StructuredOutputStats)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    expert_load: ExpertLoad | None = None  # a mixture-of-experts model's routing (None: a dense model)
    multimodal: MultiModalStats = field(default_factory=MultiModalStats)
    # The capabilities' fields, as flat names too (what the metrics, inspector and dashboard read).
    num_constrained_seqs = _Nested("structured_output")
    grammar_fill_s = _Nested("structured_output")
    grammar_wait_s = _Nested("structured_output")
    grammar_compile_s = _Nested("structured_output")
    num_constrained_requests = _Nested("structured_output")
    jump_forward_tokens = _Nested("structured_output")
    num_drafts = _Nested("spec_decoding")
    num_draft_tokens = _Nested("spec_decoding")
    num_accepted_tokens = _Nested("spec_decoding")
    num_accepted_tokens_per_pos = _Nested("spec_decoding")
    num_images_encoded = _Nested("multimodal")
    encoder_s = _Nested("multimodal")
    request_images = _Nested("multimodal")

    @property
    def budget_fill(self) -> float:
        return self.num_scheduled_tokens / self.token_budget


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # prompt tokens not yet computed, over waiting and running sequences
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_partial_prefills: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    prompt_tokens: int
    generation_tokens: int
    step_seconds: float = 0.0  # total wall time in step()
    scheduling_seconds: float = 0.0  # of it, scheduling + building the batch (host work before the model)
    num_failed_steps: int = 0  # steps that raised (their requests failed, the engine went on)
    num_failed_requests: int = 0  # requests ended with an error (their own, or their step's)
    max_batch_seqs: int = 0  # most sequences in one step so far
    # Requests (not sequences: n > 1 gives a request n of them), counted as vLLM counts them: a
    # request runs while any of its sequences is in the running batch, and waits otherwise.
    # Requests waiting for their grammar to compile count as waiting, as in vLLM (its scheduler's
    # waiting queue holds them, WAITING_FOR_FSM): num_waiting, num_waiting_tokens and
    # num_requests_waiting include them.
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_requests_waiting_grammar: int = 0  # of num_requests_waiting: those whose grammar is compiling
    num_constrained_requests: int = 0  # requests added with a constraint (structured outputs), cumulative
    # LoRA (enable_lora): adapters in device slots now, of max_loras; cumulative slot loads (an adapter
    # copied into a slot) and evictions (an adapter displaced by another), and adapters in host memory.
    lora_slots_used: int = 0
    max_loras: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    lora_adapters_loaded: int = 0
    cpu_kernels: str = ""  # the CPU GEMM kernels (cpu_ops.kernel_choice's label); empty on other devices
    # the driver rank's resident weight bytes by format (model_executor.weight_bytes), fixed at load
    weight_bytes: dict[str, int] = field(default_factory=dict)
    num_triton_compiles: int = 0  # Triton kernel variants compiled so far (GPU engines; ``jit_compiles``)
    # Recurrent layers (hybrid models): state slots held by running sequences, of max_num_seqs (0 and 0 otherwise)
    state_slots_used: int = 0
    state_slots_total: int = 0
    # and, with prefix caching, snapshots of those states at block boundaries (a hit resumes from one):
    # registered or being saved, of all (``engine/state_snapshots.py``; 0 and 0 otherwise)
    state_snapshots_used: int = 0
    state_snapshots_total: int = 0
    # Images (a model that reads them): images run through the vision encoder, images a step took from
    # the encoder cache instead (a repeated image, a chunk or re-prefill of one seen), embeddings it holds
    num_images_encoded: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_embeddings: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total
