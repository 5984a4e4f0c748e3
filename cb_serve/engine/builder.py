"""``build(config) -> EngineParts``: the model loaded (with its tensor-parallel ranks), the KV cache
sized in the memory the weights left, and every part of the step made and wired once, here."""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from cb_serve.config import EngineConfig, LoRAConfig, SpeculativeConfig
from cb_serve.cpu_ops.kernel_choice import kernel_choice
from cb_serve.distributed.sharding import shard_for
from cb_serve.engine.block_manager import BlockManager
from cb_serve.engine.inspector import Inspector
from cb_serve.engine.kv_cache_sizing import encoder_bytes, kv_cache_bytes_per_block, mtp_bytes_per_block, num_kv_blocks
from cb_serve.engine.processor import InputProcessor
from cb_serve.engine.scheduler import Scheduler
from cb_serve.engine.state_slots import StateSlots, recurrent_config
from cb_serve.engine.state_snapshots import StateSnapshots
from cb_serve.executor.base import Executor
from cb_serve.executor.tensor_parallel import TensorParallelExecutor
from cb_serve.executor.uniproc import UniProcExecutor
from cb_serve.executor.worker_pool import WorkerPool
from cb_serve.fault_injection import FaultInjector
from cb_serve.kv_cache_interface import KVCacheLayout
from cb_serve.lora.admission import LoRAAdmission
from cb_serve.lora.manager import LoRAManager
from cb_serve.model_executor import loader
from cb_serve.model_executor.cache_tensors import (
    num_state_cache_slots,
    num_state_snapshots,
    num_verify_states,
    state_bytes_per_slot,
)
from cb_serve.model_executor.cuda_graph import capture_sizes
from cb_serve.model_executor.device_context import device_context
from cb_serve.model_executor.model_runner import ModelRunner
from cb_serve.model_executor.model_setup import ModelSetup
from cb_serve.model_executor.warm_up import warm_up
from cb_serve.model_executor.weight_bytes import describe as describe_weight_bytes
from cb_serve.model_executor.weight_bytes import weight_bytes_by_format
from cb_serve.multimodal.encoder_cache import CAPACITY, ENCODER_BATCH
from cb_serve.multimodal.processor import make_processor
from cb_serve.reasoning import HarmonyReasoningEnd, reasoning_parser
from cb_serve.sequence import Sequence
from cb_serve.spec_decode.draft_model import DraftModel, DraftModelProposer
from cb_serve.spec_decode.mtp import MtpProposer
from cb_serve.spec_decode.speculator import NoSpeculation, Speculator
from cb_serve.structured_outputs.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What one engine is made of. Structured outputs are always on (a request brings its
    constraint); speculation off is ``NoSpeculation``; ``lora`` is None without ``enable_lora``."""

    config: EngineConfig
    setup: ModelSetup
    tokenizer: Any
    processor: InputProcessor
    executor: Executor
    block_manager: BlockManager
    scheduler: Scheduler
    structured: StructuredOutputManager
    speculator: Speculator | NoSpeculation
    lora: LoRAManager | None
    inspector: Inspector | None
    faults: FaultInjector | None
    cpu_kernels: str  # the CPU GEMM kernels' label; empty on other devices
    weight_bytes: dict[str, int]  # the driver rank's resident weights by format (weight_bytes.py)


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


def build(config: EngineConfig) -> EngineParts:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    setup = ModelSetup.from_config(config)
    if setup.kv_layout.state_layers:  # recurrent layers: a state slot per sequence
        config = setup.config = recurrent_config(config, setup.hf_config.model_type)
    tokenizer = loader.load_tokenizer(setup.source, config.tokenizer, config.trust_remote_code)
    spec, draft = _speculation(config, setup, tokenizer)
    vocab_size = setup.hf_config.vocab_size
    if config.reasoning_parser:
        reasoning = reasoning_parser(config.reasoning_parser, tokenizer)
    else:  # gpt-oss: a constraint applies to the final channel, after the analysis
        reasoning = HarmonyReasoningEnd.for_model(tokenizer, config.tool_call_parser)
    structured = StructuredOutputManager(tokenizer, vocab_size, config.enable_jump_forward, reasoning=reasoning)
    with device_context(setup.device):  # load, KV sizing and graph capture on the engine's device
        executor, lora, speculator = _make_executor(config, setup, draft, spec, structured)
    num_blocks = executor.runner.num_blocks
    config, slots, snapshots = _state_parts(config, setup, executor.runner)
    block_manager = BlockManager(
        num_blocks, setup.block_size, config.enable_prefix_caching, setup.kv_layout.group_windows, slots, snapshots
    )
    runner = executor.runner

    def release(seq: Sequence) -> None:  # a proposer's per-sequence state and the runner's row go with its blocks
        runner.release(seq)  # first: it cannot fail
        speculator.release(seq)

    scheduler = Scheduler(
        block_manager,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        setup.max_model_len,
        config.enable_chunked_prefill,
        LoRAAdmission(config.max_loras) if config.enable_lora else None,
        on_release=release,
        policy=config.scheduling_policy,
    )
    inspector = None
    if config.inspector_steps:
        budget = config.max_num_batched_tokens
        inspector = Inspector(config.inspector_steps, config.inspector_requests, block_manager, budget)
    eos = eos_token_ids(setup.hf_config, tokenizer)
    mm = None
    if setup.mm_config is not None:  # the checkpoint's images are served: its HF processor expands them
        mm = make_processor(setup.source.path, setup.mm_config, config.trust_remote_code)
    processor = InputProcessor(tokenizer, setup.max_model_len, vocab_size, eos, config, mm)
    choice = kernel_choice() if setup.device.type == "cpu" else None
    faults = FaultInjector.from_config(config.fault_injection)
    weights = weight_bytes_by_format(runner.model)
    ranks = f" (rank 0 of {config.tensor_parallel_size})" if config.tensor_parallel_size > 1 else ""
    logger.info("Model weights%s: %s", ranks, describe_weight_bytes(weights))
    return EngineParts(
        config, setup, tokenizer, processor, executor, block_manager, scheduler, structured, speculator, lora,
        inspector, faults, choice.label if choice is not None else "", weights,
    )  # fmt: skip


def _speculation(
    config: EngineConfig, setup: ModelSetup, tokenizer
) -> tuple[SpeculativeConfig | None, DraftModel | None]:
    """``speculative_config`` and, for method ``draft_model``, the draft (checked against the target)."""
    spec = SpeculativeConfig.from_dict(config.speculative_config) if config.speculative_config else None
    if spec is not None and spec.method == "mtp" and config.tensor_parallel_size > 1:
        raise ValueError("speculative_config method mtp runs on one rank: the target's sharded LM head would need "
                         "every rank. Use ngram or draft_model with tensor_parallel_size > 1.")  # fmt: skip
    if spec is not None and spec.method == "draft_model":
        return spec, DraftModel.for_target(config, setup, spec.model, tokenizer)
    return spec, None


def _state_parts(
    config: EngineConfig, setup: ModelSetup, runner: ModelRunner
) -> tuple[EngineConfig, StateSlots | None, StateSnapshots | None]:
    """A hybrid model's state slots (one per running sequence) and, with prefix caching, the snapshots the
    runner made room for after them; prefix caching off (logged) where none fit."""
    if not setup.kv_layout.state_layers:
        return config, None, None
    n = runner.state_cache.num_snapshots
    if config.enable_prefix_caching and n == 0:
        logger.warning("Prefix caching off: state_snapshot_memory holds no state of this model's layers.")
        config = setup.config = dataclasses.replace(config, enable_prefix_caching=False)
    elif n:
        per_slot = state_bytes_per_slot(runner.model)
        logger.info("prefix caching keeps %d recurrent-state snapshots of %.1f MiB each (num_state_snapshots)",
                    n, per_slot / 2**20)  # fmt: skip
    snapshots = StateSnapshots(n, config.max_num_seqs, setup.block_size) if n else None
    return config, StateSlots(config.max_num_seqs), snapshots


def _make_executor(
    config: EngineConfig,
    setup: ModelSetup,
    draft: DraftModel | None,
    spec: SpeculativeConfig | None,
    structured: StructuredOutputManager,
) -> tuple[Executor, LoRAManager | None, Speculator | NoSpeculation]:
    """Loads the model (this rank's shard, with the tensor-parallel workers started beside it),
    sizes the KV cache with the memory the weights left, and captures CUDA graphs."""
    size = config.tensor_parallel_size
    workers = None
    shard = shard_for(setup.hf_config, 0, size, config.enable_expert_parallel)  # raises before any worker starts
    if size > 1:
        workers = WorkerPool(config, setup.device)
    try:
        model = setup.load_model(shard, workers.group if workers else None)
        lora = None  # its slots are allocated before the KV cache is sized
        if config.enable_lora:
            lora = LoRAManager(
                model, LoRAConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras), setup.dtype
            )
        num_blocks = _num_kv_blocks(config, setup, draft, model)
        if workers is not None:
            workers.start(num_blocks)
        speculator: Speculator | NoSpeculation = NoSpeculation()
        if spec is not None:
            speculator = _make_speculator(config, spec, draft, num_blocks, setup, structured, model)
        runner = _make_runner(config, setup, model, num_blocks, lora, speculator)
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    executor = UniProcExecutor(runner) if workers is None else TensorParallelExecutor(runner, workers)
    return executor, lora, speculator


def _make_runner(
    config: EngineConfig,
    setup: ModelSetup,
    model,
    num_blocks: int,
    lora: LoRAManager | None,
    speculator: Speculator | NoSpeculation,
) -> ModelRunner:
    """The driver's model runner with its KV cache and CUDA graphs; on one GPU, the prefill kernels
    are compiled now (``warm_up``), not at a first request."""
    graph_sizes = _graph_sizes(config, setup, lora)
    runner = ModelRunner(
        model,
        num_blocks,
        setup.block_size,
        setup.kv_cache_dtype,
        setup.device,
        graph_sizes,
        setup.max_model_len,
        lora,
        speculator.verify,
        setup.kv_layout,
        record_expert_load=True,  # a mixture of experts' load per step, for the metrics and the inspector
        num_state_slots=config.max_num_seqs,
        num_state_snapshots=num_state_snapshots(config, state_bytes_per_slot(model)),
        num_verify_states=num_verify_states(config),
        hidden_sink=speculator.hidden_sink,
    )
    if setup.device.type == "cuda" and config.tensor_parallel_size == 1:
        with device_context(setup.device):
            warm_up(runner, config.max_num_batched_tokens, setup.max_model_len)
    logger.info(
        "engine ready: model=%s device=%s dtype=%s kv cache %s backend=%s blocks=%d x %d tokens, cuda graphs %s, "
        "tensor parallel %d",
        setup.source.name,
        setup.device,
        setup.dtype,
        setup.kv_cache_dtype,
        setup.backend.name,
        num_blocks,
        setup.block_size,
        graph_sizes and f"{len(graph_sizes)} sizes up to {graph_sizes[-1]}",
        config.tensor_parallel_size,
    )
    return runner


def _num_kv_blocks(config: EngineConfig, s: ModelSetup, draft: DraftModel | None, model) -> int:
    """KV blocks in the memory the weights and the recurrent layers' state slots (``max_num_seqs`` and a
    scratch one) left (a draft model's weights loaded first, and its cache, as many blocks as the
    target's, counted in; on a GPU, a model that reads images reserves its encoder's memory too)."""
    if draft is not None:
        draft.load()  # before the KV cache is sized: its weights and its cache share the memory
    rank_config = per_rank_config(s.hf_config, config.tensor_parallel_size, s.device)
    d = draft and draft.setup
    mirror = 0 if d is None else kv_cache_bytes_per_block(d.hf_config, d.block_size, d.kv_cache_dtype, d.kv_layout)
    mirror += mtp_bytes_per_block(model, s.block_size, s.kv_cache_dtype)
    per_slot = state_bytes_per_slot(model)  # the running slots, the snapshots, the verify positions', a scratch one
    states = num_state_cache_slots(config, per_slot) * per_slot
    images = s.mm_config
    encoder = 0 if images is None else encoder_bytes(images, config, s.dtype.itemsize, CAPACITY, ENCODER_BATCH)
    return num_kv_blocks(
        config, rank_config, s.block_size, s.max_model_len, s.kv_cache_dtype, s.dtype, s.device, mirror, s.kv_layout,
        states, encoder,
    )  # fmt: skip


def _graph_sizes(config: EngineConfig, setup: ModelSetup, lora: LoRAManager | None) -> list[int] | None:
    """Decode batch sizes to capture CUDA graphs for (None: eager). Graphs are captured by one
    process; tensor-parallel ranks run eagerly (docs/engine.md), and so do adapters (their
    token groups change every step). Hybrid models' recurrent layers replay too: their decode kernels
    read the state slots on the device, and a padding row's slot -1 is skipped."""
    mtp = (config.speculative_config or {}).get("method") == "mtp"  # its proposer reads every row's hidden state
    graphable = config.tensor_parallel_size == 1 and lora is None and not config.enforce_eager and not mtp
    if setup.device.type == "cuda" and setup.backend.supports_cuda_graphs and graphable:
        return capture_sizes(config.max_num_seqs)
    return None


def _make_speculator(
    config: EngineConfig,
    spec: SpeculativeConfig,
    draft: DraftModel | None,
    num_blocks: int,
    setup: ModelSetup,
    structured: StructuredOutputManager,
    model,
) -> Speculator:
    """The speculator; with a draft model or the checkpoint's MTP layers, its proposer has a KV cache of its own
    with as many blocks as the target's (sized together, ``_num_kv_blocks``)."""
    budget = config.max_num_batched_tokens
    proposer = None
    if draft is not None:
        blocks = BlockManager(num_blocks, setup.block_size, False, draft.setup.kv_layout.group_windows)
        proposer = DraftModelProposer(draft.runner(num_blocks), blocks, budget)
    elif spec.method == "mtp":
        layout = KVCacheLayout.from_windows([None] * len(model.mtp.layers))
        runner = ModelRunner(model.mtp, num_blocks, setup.block_size, setup.kv_cache_dtype, setup.device,
                             kv_layout=layout)  # fmt: skip
        blocks = BlockManager(num_blocks, setup.block_size, False, layout.group_windows)
        proposer = MtpProposer(runner, blocks, budget, model.norm)
    return Speculator(spec, setup.max_model_len, budget, proposer, structured.valid_drafts)
