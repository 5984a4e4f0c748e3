"""Paged KV-cache bookkeeping: block tables, ref counts, prefix caching with LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from cb_serve.prefix_hash import CountingBloom, PrefixDigest, chain_hash, num_hit_blocks
from cb_serve.sequence import Sequence


class BlockManager:
    """Owns which KV blocks each sequence uses.

    A full block whose KV is computed is registered under its chained hash; when freed it
    stays free *with* its content, so a later prompt with the same prefix takes it back (a
    prefix-cache hit) until it is evicted by reuse. ``digest()`` summarizes the cached blocks
    for the router (``prefix_hash.PrefixDigest``).

    Free blocks are handed out in this order: uncached ones first, the last freed first; then
    blocks never used yet, by id; then cached ones, least recently freed first (``free`` frees
    a table's tail first, so a prefix outlives its tail). State is kept per block only for
    blocks ever handed out (ids below ``len(self._refs)``; the rest are free and untouched)
    and per cached block, so a manager of millions of blocks costs next to nothing to build.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs: list[int] = []  # ref counts of blocks 0..len-1, grown as blocks are first used
        self._free_uncached: list[int] = []  # a stack: the last freed is reused first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._content: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block id -> (hash, token ids), if cached
        self.cached: dict[bytes, int] = {}  # chained hash -> block id
        self.block_hashes: dict[str, list[bytes]] = {}  # seq id -> hashes of its full blocks
        self.num_registered: dict[str, int] = {}  # seq id -> leading blocks already registered
        self.num_evictions = 0  # cached blocks whose content was dropped for reuse
        self.bloom = CountingBloom(num_blocks, block_size) if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - len(self._refs) + len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix (evicted last, revived by a prefix hit)."""
        return len(self._free_cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- per-block state ------------------------------------------------------------
    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id`` (0: free)."""
        return self._refs[block_id] if block_id < len(self._refs) else 0

    def block_hash(self, block_id: int) -> bytes | None:
        """The chained hash ``block_id`` is cached under, or None."""
        content = self._content.get(block_id)
        return None if content is None else content[0]

    def block_tokens(self, block_id: int) -> tuple[int, ...]:
        """The token ids a cached block holds (``()`` if it is not cached)."""
        content = self._content.get(block_id)
        return () if content is None else content[1]

    def free_blocks(self) -> Iterator[int]:
        """The free block ids, in the order they will be handed out."""
        yield from reversed(self._free_uncached)
        yield from range(len(self._refs), self.num_blocks)
        yield from self._free_cached

    # ---- prefix caching -------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes = self.block_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        salt = None if seq.lora is None else seq.lora.cache_salt  # two adapters never share KV
        for i in range(len(hashes), num_full_blocks):
            hashes.append(chain_hash(hashes[-1] if hashes else salt, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (never all of its tokens:
        the last one must be computed to get logits)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = num_hit_blocks(seq.num_tokens, self.block_size)
        hit: list[int] = []
        bs = self.block_size
        for i, h in enumerate(self._hashes(seq, max_blocks)[:max_blocks]):
            block_id = self.cached.get(h)
            if block_id is None or self._content[block_id][1] != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hit.append(block_id)
        return hit

    def _register_full_blocks(self, seq: Sequence) -> None:
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self.num_registered.get(seq.seq_id, 0)
        hashes = self._hashes(seq, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            block_id = seq.block_table[i]
            if block_id not in self._content and hashes[i] not in self.cached:
                self._content[block_id] = (hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                self.cached[hashes[i]] = block_id
                self.bloom.add(hashes[i])
        self.num_registered[seq.seq_id] = max(start, num_full)

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: Iterable[int] = ()) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens (after taking
        ``cached_blocks``, its prefix hit, if any). Returns False, changing nothing, if the
        pool is too small."""
        cached_blocks = list(cached_blocks)
        assert not cached_blocks or not seq.block_table, "a prefix hit only starts a block table"
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else seq.num_computed_tokens
        total_blocks = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = total_blocks - len(seq.block_table) - len(cached_blocks)
        refs = self._refs
        num_needed = max(num_new_blocks, 0) + sum(1 for b in cached_blocks if refs[b] == 0)
        if num_needed and num_needed > self.num_free_blocks:
            return False
        table = seq.block_table
        for block_id in cached_blocks:
            if refs[block_id] == 0:
                del self._free_cached[block_id]
            refs[block_id] += 1
            table.append(block_id)
        for _ in range(num_new_blocks):
            if self._free_uncached:
                block_id = self._free_uncached.pop()
                refs[block_id] = 1
            elif len(refs) < self.num_blocks:
                block_id = len(refs)
                refs.append(1)
            else:  # evict the least recently freed cached block
                block_id, _ = self._free_cached.popitem(last=False)
                self.num_evictions += 1
                self._uncache(block_id)
                refs[block_id] = 1
            table.append(block_id)
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """Call after a step raised ``seq.num_computed_tokens``: registers newly full blocks."""
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks; tail blocks first, so they are evicted before the prefix."""
        refs, content = self._refs, self._content
        for block_id in reversed(seq.block_table):
            n = refs[block_id] - 1
            assert n >= 0
            refs[block_id] = n
            if n == 0:
                if block_id in content:
                    self._free_cached[block_id] = None
                else:
                    self._free_uncached.append(block_id)
        seq.block_table = []
        self.num_registered.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence hash state once a sequence is finished for good."""
        self.block_hashes.pop(seq.seq_id, None)

    def _uncache(self, block_id: int) -> None:
        block_hash, _ = self._content.pop(block_id)
        del self.cached[block_hash]
        self.bloom.remove(block_hash)

    def reset_prefix_cache(self) -> None:
        """Drops the content of every free cached block; they join the uncached free blocks
        (least recently freed on top)."""
        for block_id in self._free_cached:
            self._uncache(block_id)
        self._free_uncached.extend(reversed(self._free_cached))
        self._free_cached.clear()

    def digest(self) -> PrefixDigest | None:
        """What the prefix cache holds, for routing; None without prefix caching."""
        return self.bloom.digest() if self.bloom is not None else None

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Every block is either free (ref 0, free once) or referenced exactly as often as it
        appears in live block tables; cached hashes point at their blocks. O(blocks used so far)."""
        num_touched = len(self._refs)
        refs = [0] * num_touched
        for seq in live:
            for block_id in seq.block_table:
                assert 0 <= block_id < num_touched, (block_id, num_touched)
                refs[block_id] += 1
        if refs != self._refs:
            bad = next(b for b in range(num_touched) if refs[b] != self._refs[b])
            raise AssertionError((bad, self._refs[bad], refs[bad]))
        free = [*self._free_uncached, *self._free_cached]
        assert len(set(free)) == len(free) == refs.count(0), "a free block twice, or a ref-0 block not free"
        assert all(refs[b] == 0 for b in free)
        assert not any(b in self._content for b in self._free_uncached)
        assert all(b in self._content for b in self._free_cached)
        assert len(self._content) == len(self.cached)
        for h, block_id in self.cached.items():
            assert self._content[block_id][0] == h
        if self.bloom is not None:
            expected = CountingBloom(self.num_blocks, self.block_size)
            for h in self.cached:
                expected.add(h)
            assert (expected.counts == self.bloom.counts).all() and self.bloom.num_entries == len(self.cached)
