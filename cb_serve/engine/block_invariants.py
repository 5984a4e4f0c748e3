"""The block manager's invariants (``BlockManager.check_invariants``): what tests and the engine's own
``check_invariants`` assert after every step of a soak, kept apart from the bookkeeping they check."""

from __future__ import annotations

from typing import Any

from cb_serve.kv_cache_interface import NULL_BLOCK
from cb_serve.prefix_hash import CountingBloom
from cb_serve.sequence import Sequence


def check_blocks(bm: Any, live: list[Sequence]) -> None:
    """``bm``, a ``BlockManager`` (not imported: it calls this): every block is either free (ref 0, free
    once) or referenced exactly as often as it appears in live block tables; cached hashes point at their
    blocks; the router's Bloom counts are the cached hashes'."""
    num_touched = len(bm._refs)
    refs = [0] * num_touched
    for seq in live:
        assert len({len(t) for t in seq.block_tables}) == 1, "groups' tables of one length"
        for g, table in enumerate(seq.block_tables):
            live_blocks = [b for b in table if b != NULL_BLOCK]
            assert bm.group_windows[g] is not None or len(live_blocks) == len(table), "a hole in a full group"
            assert table[len(table) - len(live_blocks) :] == live_blocks, "a hole after a live block"
            for block_id in live_blocks:
                assert 0 <= block_id < num_touched, (block_id, num_touched)
                refs[block_id] += 1
    if refs != bm._refs:
        bad = next(b for b in range(num_touched) if refs[b] != bm._refs[b])
        raise AssertionError((bad, bm._refs[bad], refs[bad]))
    free = [*bm._free_uncached, *bm._free_cached]
    assert len(set(free)) == len(free) == refs.count(0), "a free block twice, or a ref-0 block not free"
    assert all(refs[b] == 0 for b in free)
    assert not any(b in bm._content for b in bm._free_uncached)
    assert all(b in bm._content for b in bm._free_cached)
    assert len(bm._content) == sum(len(c) for c in bm.cached_by_group)
    for g, cached in enumerate(bm.cached_by_group):
        for h, block_id in cached.items():
            assert bm._content[block_id][:2] == (g, h)
    if bm.bloom is not None:
        expected = CountingBloom(bm.num_blocks, bm.block_size)
        for h in bm.cached:
            expected.add(h)
        assert (expected.counts == bm.bloom.counts).all() and bm.bloom.num_entries == len(bm.cached)
