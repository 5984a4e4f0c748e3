"""The cache tensors a model runner owns: each attention layer's paged KV (by KV-cache group, as
``kv_cache_interface`` lays them out) and each recurrent layer's state slots (``StateCache``)."""

from __future__ import annotations

import torch

from cb_serve.attention.base import host_to_device
from cb_serve.kv_cache_interface import KVCacheLayout, StateSpec


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
    sequence's slot (``engine/state_slots.py``; the last slot is the runner's scratch)."""

    def __init__(self, specs: dict[int, StateSpec], num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.layers = {
            layer: (
                torch.zeros(num_slots, *spec.conv_shape, dtype=torch.float32, device=device),
                torch.zeros(num_slots, *spec.ssm_shape, dtype=torch.float32, device=device),
            )
            for layer, spec in specs.items()
        }

    def reset(self, slots: list[int], query_lens: list[int], seq_lens: list[int]) -> None:
        """Zero the slots of the rows that start their sequence (no token computed before this step)."""
        fresh = [slot for slot, q, n in zip(slots, query_lens, seq_lens) if q == n and slot >= 0]
        if not fresh:
            return
        index = host_to_device(torch.tensor(fresh), next(iter(self.layers.values()))[0].device)
        for conv, ssm in self.layers.values():
            conv.index_fill_(0, index, 0.0)
            ssm.index_fill_(0, index, 0.0)
