"""Paged KV-cache bookkeeping: block tables, ref counts, prefix caching with LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from cb_serve.prefix_hash import CountingBloom, PrefixDigest, chain_hash, num_hit_blocks
from cb_serve.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # set once the block is full and registered for reuse
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Owns which KV blocks each sequence uses.

    Free blocks wait in an LRU pool. A full block whose KV is computed is registered under
    its chained hash; when freed it stays in the pool *with* its content, so a later prompt
    with the same prefix takes it back (a prefix-cache hit) until it is evicted by reuse.
    Uncached free blocks are handed out before cached ones. ``digest()`` summarizes the cached
    blocks for the router (``prefix_hash.PrefixDigest``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_pool: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # chained hash -> block id
        self.block_hashes: dict[str, list[bytes]] = {}  # seq id -> hashes of its full blocks
        self.num_registered: dict[str, int] = {}  # seq id -> leading blocks already registered
        self.num_evictions = 0  # cached blocks whose content was dropped for reuse
        self._num_cached_free = 0
        self.bloom = CountingBloom(num_blocks, block_size) if enable_prefix_caching else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_pool)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_pool)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix (evicted last, revived by a prefix hit)."""
        return self._num_cached_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hit.append(block_id)
        return hit

    def _register_full_blocks(self, seq: Sequence) -> None:
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self.num_registered.get(seq.seq_id, 0)
        hashes = self._hashes(seq, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.cached[hashes[i]] = block.block_id
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
        num_revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(num_new_blocks, 0) + num_revived > len(self.free_pool):
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_pool[block_id]
                self._num_cached_free -= 1
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_pool.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:  # evict its cached content
            self.num_evictions += 1
            self._num_cached_free -= 1
            self._uncache(block)
        block.ref_count = 1
        return block_id

    def commit_computed(self, seq: Sequence) -> None:
        """Call after a step raised ``seq.num_computed_tokens``: registers newly full blocks."""
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks; tail blocks first, so they are evicted before the prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_pool[block_id] = None
                if block.hash is None:
                    self.free_pool.move_to_end(block_id, last=False)
                else:
                    self._num_cached_free += 1
        seq.block_table = []
        self.num_registered.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence hash state once a sequence is finished for good."""
        self.block_hashes.pop(seq.seq_id, None)

    def _uncache(self, block: Block) -> None:
        del self.cached[block.hash]
        self.bloom.remove(block.hash)
        block.hash, block.token_ids = None, ()

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_pool:
            block = self.blocks[block_id]
            if block.hash is not None:
                self._uncache(block)
        self._num_cached_free = 0

    def digest(self) -> PrefixDigest | None:
        """What the prefix cache holds, for routing; None without prefix caching."""
        return self.bloom.digest() if self.bloom is not None else None

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Every block is either free (ref 0, in the pool once) or referenced exactly as
        often as it appears in live block tables; cached hashes point at their blocks."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (block.block_id, block.ref_count, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self.free_pool)
        assert self._num_cached_free == sum(1 for b in self.free_pool if self.blocks[b].hash is not None)
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h
        if self.bloom is not None:
            expected = CountingBloom(self.num_blocks, self.block_size)
            for h in self.cached:
                expected.add(h)
            assert (expected.counts == self.bloom.counts).all() and self.bloom.num_entries == len(self.cached)
