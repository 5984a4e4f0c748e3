"""Adapter memory: ``max_loras`` slots on the model's device hold the adapters of the running
sequences, refilled in LRU order; up to ``max_cpu_loras`` more stay loaded in host memory."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cb_serve.config.lora import LoRAConfig
from cb_serve.errors import InvalidRequestError
from cb_serve.lora.layers import LoRABatch, LoRALinear
from cb_serve.lora.peft_adapter import (
    FUSED_PROJECTIONS,
    LoRAAdapterError,
    LoRAWeights,
    ProjectionShape,
    load_peft_adapter,
)
from cb_serve.lora_request import LoRARequest
from cb_serve.stats import LoRAStats

AdapterKey = tuple[str, int, str]


@dataclass
class LoRACounters:
    num_loads: int = 0  # adapters copied into a slot
    num_evictions: int = 0  # adapters displaced from a slot by another
    num_reads: int = 0  # adapters read from disk into host memory
    num_cpu_evictions: int = 0  # idle adapters dropped from host memory


def wrap_projections(model: torch.nn.Module, batch: LoRABatch, config: LoRAConfig) -> dict[str, LoRALinear]:
    """Replaces every decoder layer's fused projections with ``LoRALinear``s sharing ``batch``."""
    wrapped = {}
    for i, layer in enumerate(model.layers):
        for fused, subs in FUSED_PROJECTIONS.items():
            block, attr = fused.split(".")
            parent = getattr(layer, block, None)  # a recurrent layer has its mixer, an attention layer self_attn
            if not hasattr(parent, attr):  # a mixture-of-experts layer: adapters serve its attention only
                continue
            module = LoRALinear(getattr(parent, attr), batch, config.max_loras, len(subs) * config.max_lora_rank)
            setattr(parent, attr, module)
            wrapped[f"layers.{i}.{fused}"] = module
    return wrapped


def projection_shapes(model: torch.nn.Module) -> dict[str, ProjectionShape]:
    """Each layer's fused projections (Gemma 4's layers differ: head sizes, no k/v projections; a hybrid
    model's recurrent layers have their mixer's, ``lora_in_proj``)."""
    hidden, shapes = model.config.hidden_size, {}
    for i, layer in enumerate(model.layers):
        inter = getattr(layer.mlp, "intermediate_size", 0)
        if hasattr(layer, "mixer"):
            parts, grouped = layer.mixer.lora_in_proj()
            per_layer = {
                "mixer.in_proj": ProjectionShape(hidden, parts, grouped),
                "mixer.out_proj": ProjectionShape(layer.mixer.out_proj.in_features, (hidden,)),
            }
        else:
            attn = layer.self_attn
            per_layer = {
                "self_attn.qkv_proj": ProjectionShape(hidden, attn.qkv_sizes, attn.lora_grouped()),
                "self_attn.o_proj": ProjectionShape(attn.q_size, (hidden,)),
            }
        if hasattr(layer.mlp, "gate_up_proj"):  # a dense MLP (not a mixture of experts)
            per_layer["mlp.gate_up_proj"] = ProjectionShape(hidden, (inter, inter))
            per_layer["mlp.down_proj"] = ProjectionShape(inter, (hidden,))
        shapes.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def checked(manager: LoRAManager | None, lora_request: object) -> LoRAManager:
    """The engine's manager for serving ``lora_request``; ``InvalidRequestError`` (param
    ``lora_request``) when adapters are off or it is no ``LoRARequest``."""
    if manager is None:
        raise InvalidRequestError("LoRA adapters are not enabled on this engine (enable_lora).", "lora_request")
    if not isinstance(lora_request, LoRARequest):
        raise InvalidRequestError(f"Expected a LoRARequest, got {type(lora_request).__name__}.", "lora_request")
    return manager


def lora_stats(manager: LoRAManager | None) -> LoRAStats:
    """The adapters' stats (all zero without adapters)."""
    return LoRAStats() if manager is None else manager.stats()


def adapter_ids(manager: LoRAManager | None) -> list[int]:
    """``lora_int_id`` of the adapters held (none without adapters); safe from any thread."""
    return [] if manager is None else manager.adapter_ids()


class LoRAManager:
    """Owns the adapters: ``add`` reads one into host memory (validated against the model), and
    ``set_active_loras`` (the model runner's, as it prepares a step) puts the step's adapters in
    device slots. The scheduler keeps at most ``max_loras`` adapters running. Errors a client
    caused are ``InvalidRequestError`` (param ``lora_request``)."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.shapes = projection_shapes(model)
        self.batch = LoRABatch()
        self.layers = wrap_projections(model, self.batch, config)
        self.loaded: OrderedDict[AdapterKey, LoRAWeights] = OrderedDict()  # host memory, LRU first
        self.slots: list[AdapterKey | None] = [None] * config.max_loras
        self.slot_order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(config.max_loras))
        self.counters = LoRACounters()

    def held(self, key: AdapterKey) -> LoRAWeights | None:
        """The adapter's weights if held in host memory (safe from any thread: one dict lookup)."""
        return self.loaded.get(key)

    def adapter_ids(self) -> list[int]:
        """``lora_int_id`` of every adapter held (in host memory or a slot)."""
        return sorted({key[1] for key in [*list(self.loaded), *self.slots] if key is not None})

    @property
    def num_slots_used(self) -> int:
        return sum(key is not None for key in self.slots)

    def stats(self) -> LoRAStats:
        c = self.counters
        return LoRAStats(self.num_slots_used, self.config.max_loras, c.num_loads, c.num_evictions, len(self.loaded))

    def read(self, request: LoRARequest) -> LoRAWeights:
        """The adapter read from disk and checked against the model, or the weights already held;
        touches nothing of the manager's state, so any thread may call it."""
        held = self.held(request.key)
        if held is not None:
            return held
        try:
            return load_peft_adapter(
                request.lora_name, request.lora_path, self.shapes, self.config.max_lora_rank, self.dtype
            )
        except LoRAAdapterError as e:
            raise InvalidRequestError(str(e), "lora_request") from e

    def add(
        self,
        request: LoRARequest,
        in_use: Callable[[], set[AdapterKey]] = set,
        weights: LoRAWeights | None = None,
    ) -> LoRAWeights:
        """Holds the adapter in host memory (``weights`` if already ``read``, else read now; held
        already: only its LRU place is refreshed), then drops idle adapters (in no slot and not
        ``in_use``) beyond ``max_cpu_loras``."""
        key = request.key
        held = self.loaded.get(key)
        if held is None:
            held = weights or self.read(request)
            self.counters.num_reads += 1
            self.loaded[key] = held
        self.loaded.move_to_end(key)
        self._trim_host_memory(in_use)
        return held

    def _trim_host_memory(self, in_use: Callable[[], set[AdapterKey]]) -> None:
        excess = len(self.loaded) - self.config.cpu_capacity
        if excess <= 0:
            return
        keep = in_use() | set(self.slots) | {next(reversed(self.loaded))}  # and the newest
        for key in [k for k in self.loaded if k not in keep][:excess]:
            del self.loaded[key]
            self.counters.num_cpu_evictions += 1

    def set_active_loras(self, adapters: list[LoRARequest | None], token_rows: np.ndarray, device) -> None:
        """The step's adapters (one per row of the batch; None: the base model) in slots (at most
        ``max_loras``), refilling the least recently used slots the step does not need, and each
        token's slot (``token_rows``: the row of each token of the step) for ``LoRALinear``."""
        needed = {a.key: a for a in adapters if a is not None}
        assert len(needed) <= self.config.max_loras, f"{len(needed)} adapters running, over max_loras"
        slot_of = {key: s for s, key in enumerate(self.slots) if key is not None}
        missing = [key for key in needed if key not in slot_of]
        free = (s for s in self.slot_order if self.slots[s] not in needed)
        for key, slot in zip(missing, free):
            self._fill(slot, needed[key])
            slot_of[key] = slot
        for key in needed:
            self.slot_order.move_to_end(slot_of[key])
        row_slots = np.asarray([-1 if a is None else slot_of[a.key] for a in adapters], dtype=np.int64)
        self.batch.set_groups(row_slots[token_rows], device)

    def _fill(self, slot: int, request: LoRARequest) -> None:
        key = request.key
        weights = self.loaded.get(key) or self.read(request)  # held: every request's adapter stays in memory
        if self.slots[slot] is not None:
            self.counters.num_evictions += 1
        for name, layer in self.layers.items():
            layer.set_slot(slot, weights.modules.get(name))
        self.slots[slot] = key
        self.counters.num_loads += 1
