"""The cache tensors a model runner owns: each attention layer's paged KV (by KV-cache group, as
``kv_cache_interface`` lays them out) and each recurrent layer's state slots (``StateCache``)."""

from __future__ import annotations

import torch

from cb_serve.attention.base import host_to_device
from cb_serve.config import EngineConfig
from cb_serve.kv_cache_interface import KVCacheLayout, StateSpec


def state_bytes_per_slot(model: torch.nn.Module) -> int:
    """One state of every recurrent layer of ``model`` (this rank's shard), in bytes (0: no such layer)."""
    return sum(spec.bytes_per_slot for spec in model.state_specs().values())


def num_state_snapshots(config: EngineConfig, bytes_per_state: int) -> int:
    """How many snapshots a hybrid model keeps (``bytes_per_state``: one state of every recurrent layer on
    this rank): ``num_state_snapshots``, else ``state_snapshot_memory``'s worth, by default ``max_num_seqs``;
    none without prefix caching."""
    if not config.enable_prefix_caching or bytes_per_state == 0:
        return 0
    if config.num_state_snapshots is not None:
        return config.num_state_snapshots
    if config.state_snapshot_memory is None:
        return config.max_num_seqs
    return config.state_snapshot_memory // bytes_per_state


def kv_cache_tensors(
    model: torch.nn.Module,
    layout: KVCacheLayout,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Each layer's ``[2, num_blocks, block_size, kv_heads, head_dim]`` cache (this rank's KV heads): layer
    j of every KV-cache group views tensor j (its block ids differ), a KV-shared layer its source's. Layers
    sharing a tensor may differ in heads and head size, not in a page's width."""
    recurrent = set(layout.state_layers)  # no KV: the runner puts their state tensors in their places
    shapes = [
        (0, 0) if i in recurrent else (layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
        for i, layer in enumerate(model.layers)
    ]
    widths: dict[int, int] = {}
    for i, ((heads, dim), j) in enumerate(zip(shapes, layout.layer_tensors)):
        if i in recurrent:
            continue
        if widths.setdefault(j, heads * dim) != heads * dim:
            raise ValueError(
                f"Layers of different KV widths ({widths[j]} and {heads * dim} per token) would share a KV-cache "
                "tensor; such a model needs disable_hybrid_kv_cache_manager or is not supported."
            )
    flat = {j: torch.zeros(2, num_blocks, block_size, w, dtype=dtype, device=device) for j, w in widths.items()}
    views = zip(shapes, layout.layer_tensors)
    return [flat[j].view(2, num_blocks, block_size, heads, dim) if heads else None for (heads, dim), j in views]


class StateCache:
    """Per recurrent layer, ``(conv, ssm)`` state tensors ``[num_slots, *shape]`` (float32), indexed by a
    sequence's slot (``engine/state_slots.py``), then the snapshots' (``engine/state_snapshots.py``); the last
    slot is the runner's scratch (slot -1: warm-up and a graph's padding rows)."""

    def __init__(self, specs: dict[int, StateSpec], num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.layers = {
            layer: (
                torch.zeros(num_slots, *spec.conv_shape, dtype=torch.float32, device=device),
                torch.zeros(num_slots, *spec.ssm_shape, dtype=torch.float32, device=device),
            )
            for layer, spec in specs.items()
        }

    def begin_step(self, copies, slots: list[int], query_lens: list[int], seq_lens: list[int]) -> None:
        """Before a step's forward pass: prefix hits' states restored (``StateCopies.restores``, or None), and
        the slots of the rows that start their sequence (no token computed before this step) zeroed."""
        if copies is not None:
            self.copy(copies.restores)
        fresh = [slot for slot, q, n in zip(slots, query_lens, seq_lens) if q == n and slot >= 0]
        if not fresh:
            return
        index = host_to_device(torch.tensor(fresh), next(iter(self.layers.values()))[0].device)
        for conv, ssm in self.layers.values():
            conv.index_fill_(0, index, 0.0)
            ssm.index_fill_(0, index, 0.0)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Slot ``dst`` of every layer's tensors becomes a copy of slot ``src``, for each ``(src, dst)``, in order."""
        if not pairs:
            return
        device = next(iter(self.layers.values()))[0].device
        src, dst = (host_to_device(torch.tensor(column), device) for column in zip(*pairs))
        for tensors in self.layers.values():
            for t in tensors:
                t.index_copy_(0, dst, t.index_select(0, src))
