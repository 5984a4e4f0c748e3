"""The cache tensors a model runner owns: each attention layer's paged KV (by KV-cache group, as
``kv_cache_interface`` lays them out), and how many state slots a hybrid model's recurrent layers get
(``state_cache.StateCache`` holds them)."""

from __future__ import annotations

import torch

from cb_serve.config import EngineConfig
from cb_serve.config.speculative import SpeculativeConfig
from cb_serve.kv_cache_interface import KVCacheLayout


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


def num_verify_states(config: EngineConfig) -> int:
    """How many per-position states a speculating sequence of a hybrid model keeps while its drafts are verified
    (``num_speculative_tokens``; 0 without speculative decoding)."""
    if not config.speculative_config:
        return 0
    return SpeculativeConfig.from_dict(config.speculative_config).num_speculative_tokens


def num_state_cache_slots(config: EngineConfig, bytes_per_state: int) -> int:
    """Every state slot of a hybrid model's ``StateCache`` (0 without recurrent layers): the running sequences',
    the snapshots, the verify positions' and the scratch one."""
    if bytes_per_state == 0:
        return 0
    snapshots = num_state_snapshots(config, bytes_per_state)
    return config.max_num_seqs * (1 + num_verify_states(config)) + snapshots + 1


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
