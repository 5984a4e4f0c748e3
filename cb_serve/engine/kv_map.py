"""The inspector's map of the KV cache: each block's state, owners and hash prefix, or, for a
cache of more blocks than the map has cells, counts per group of consecutive blocks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from cb_serve.engine.block_manager import BlockManager
from cb_serve.kv_cache_interface import NULL_BLOCK
from cb_serve.sequence import Sequence


def kv_map(bm: BlockManager, live: Iterable[Sequence], max_cells: int) -> dict[str, Any]:
    """``{num_blocks, block_size, group, kv_groups, cells}``: one cell per block (with the KV-cache
    group it serves, ``kv_group``, when the model has several), or (over ``max_cells`` blocks) per
    group of them, counted from the used and cached blocks only."""
    owners: dict[int, list[str]] = {}
    kv_group: dict[int, int] = {}
    for seq in live:
        for g, table in enumerate(seq.block_tables):
            for block_id in table:
                if block_id != NULL_BLOCK:
                    owners.setdefault(block_id, []).append(seq.request_id)
                    kv_group[block_id] = g
    group = -(-bm.num_blocks // max_cells)
    cells = []
    if group == 1:
        for block_id in range(bm.num_blocks):
            ref, block_hash = bm.ref_count(block_id), bm.block_hash(block_id)
            state = "used" if ref else ("cached" if block_hash is not None else "free")
            own = sorted(set(owners.get(block_id, ())))
            digest = block_hash.hex()[:8] if block_hash else None
            cell = {"state": state, "owners": own, "shared": ref > 1, "hash": digest}
            if bm.num_groups > 1:
                cell["kv_group"] = kv_group.get(block_id, bm.block_group(block_id))
            cells.append(cell)
    else:  # O(blocks in use or cached), not O(blocks)
        used, shared, cached = Counter(), Counter(), Counter()
        cell_owners: dict[int, set[str]] = {}
        for block_id, own in owners.items():
            cell_owners.setdefault(block_id // group, set()).update(own)
        for block_id in {*owners, *bm.cached_blocks()}:
            ref = bm.ref_count(block_id)
            used[block_id // group] += ref > 0
            shared[block_id // group] += ref > 1
            cached[block_id // group] += ref == 0 and bm.block_hash(block_id) is not None
        for cell, start in enumerate(range(0, bm.num_blocks, group)):
            size = min(group, bm.num_blocks - start)
            n_used, n_cached = used[cell], cached[cell]
            state = "used" if n_used * 2 >= size else ("cached" if n_cached * 2 >= size else "free")
            cells.append({"state": state, "owners": sorted(cell_owners.get(cell, ()))[:1],
                          "shared": shared[cell] > 0, "used": n_used, "cached": n_cached,
                          "blocks": size})  # fmt: skip
    return {
        "num_blocks": bm.num_blocks,
        "block_size": bm.block_size,
        "group": group,
        "kv_groups": bm.group_windows,
        "cells": cells,
    }
