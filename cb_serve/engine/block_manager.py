"""Paged KV-cache bookkeeping: block tables per KV-cache group, ref counts, prefix caching with LRU
eviction, and sliding-window groups that free what their window no longer sees."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq

from cb_serve.engine.block_invariants import check_blocks
from cb_serve.engine.state_slots import StateSlots
from cb_serve.engine.state_snapshots import StateSnapshots
from cb_serve.kv_cache_interface import NULL_BLOCK
from cb_serve.prefix_hash import CountingBloom, PrefixDigest, PrefixHit, block_extra_keys, chain_hash, num_hit_blocks
from cb_serve.sequence import Sequence


class BlockManager:
    """Owns which KV blocks each sequence uses, in each KV-cache group (``kv_cache_interface``):
    ``seq.block_tables[g]`` is group ``g``'s table; all groups share the pool.

    A full block whose KV is computed is registered under its chained hash; when freed it
    stays free *with* its content, so a later prompt with the same prefix takes it back (a
    prefix-cache hit) until it is evicted by reuse. ``digest()`` summarizes the cached blocks
    for the router (``prefix_hash.PrefixDigest``).

    Free blocks are handed out in this order: uncached ones first, the last freed first; then
    blocks never used yet, by id; then cached ones, least recently freed first (``free`` frees
    a table's tail first, so a prefix outlives its tail). State is kept per block only for
    blocks ever handed out (ids below ``len(self._refs)``; the rest are free and untouched)
    and per cached block, so a manager of millions of blocks costs next to nothing to build.

    A sliding-window group (``group_windows[g]`` not None) gives back, each time a sequence is
    allocated for, the blocks no later token can see (their table entries become ``NULL_BLOCK``);
    they stay cached. A prefix hit then needs, in such a group, only the window's blocks before
    the hit point. Prefix-cache hashes are the same in every group (the tokens'); each group keeps
    its own blocks under them, and the router's digest counts the first group's.

    A hybrid model's recurrent layers hold a state slot per running sequence (``state_slots``), taken and
    given back with its blocks; with prefix caching, a hit also needs a snapshot of those states at its
    end (``snapshots``, ``engine/state_snapshots.py``), which the hit's step restores.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        group_windows: Seq[int | None] = (None,),
        state_slots: StateSlots | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> None:
        assert num_blocks > 0 and block_size > 0 and group_windows
        assert not (enable_prefix_caching and state_slots and not snapshots), "a hybrid model's hit needs its states"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self._refs: list[int] = []  # ref counts of blocks 0..len-1, grown as blocks are first used
        self._free_uncached: list[int] = []  # a stack: the last freed is reused first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._content: dict[int, tuple[int, bytes, tuple[int, ...]]] = {}  # block -> (group, hash, tokens), if cached
        self.cached_by_group: list[dict[bytes, int]] = [{} for _ in self.group_windows]  # chained hash -> block id
        self.block_hashes: dict[str, list[bytes]] = {}  # seq id -> hashes of its full blocks
        self.num_registered: dict[str, int] = {}  # seq id -> leading blocks already registered
        self.num_evictions = 0  # cached blocks whose content was dropped for reuse
        self.bloom = CountingBloom(num_blocks, block_size) if enable_prefix_caching else None
        self.state_slots = state_slots  # recurrent layers' slots, taken and freed with the blocks
        self.snapshots = snapshots if enable_prefix_caching else None  # their states at block boundaries
        self._all_full = all(w is None for w in self.group_windows)  # no group gives blocks back as it goes

    @property
    def cached(self) -> dict[bytes, int]:
        """The first group's cached blocks by chained hash (the router's digest counts these)."""
        return self.cached_by_group[0]

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
        return None if content is None else content[1]

    def block_tokens(self, block_id: int) -> tuple[int, ...]:
        """The token ids a cached block holds (``()`` if it is not cached)."""
        content = self._content.get(block_id)
        return () if content is None else content[2]

    def block_group(self, block_id: int) -> int | None:
        """The group a cached block's content belongs to (None: not cached)."""
        content = self._content.get(block_id)
        return None if content is None else content[0]

    def cached_blocks(self) -> Iterator[int]:
        """Every cached block id, used or free, of every group."""
        return iter(self._content)

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
        extra = block_extra_keys(seq.mm_features, bs, num_full_blocks) if seq.mm_features else None
        for i in range(len(hashes), num_full_blocks):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            hashes.append(chain_hash(hashes[-1] if hashes else salt, tokens, extra[i] if extra else b""))
        return hashes

    def _lookup(self, group: int, index: int, block_hash: bytes, seq: Sequence) -> int | None:
        block_id = self.cached_by_group[group].get(block_hash)
        bs = self.block_size
        if block_id is None or self._content[block_id][2] != tuple(seq.token_ids[index * bs : (index + 1) * bs]):
            return None
        return block_id

    def _window_start(self, group: int, num_tokens: int) -> int:
        """The first block a sliding group still needs once ``num_tokens`` are computed (0: full)."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of ``seq`` that every group can serve (never all of its tokens:
        the last one must be computed to get logits): full groups need each of its blocks, sliding
        groups the blocks of the window before its end."""
        bs = self.block_size
        # A sequence still computing prompt logprobs recomputes its prompt (``prompt_logprobs.py``).
        n = num_hit_blocks(seq.num_tokens, bs) if self.enable_prefix_caching and not seq.needs_prompt_logprobs else 0
        hashes = self._hashes(seq, n)[:n] if n else []
        found: list[list[int | None]] = []  # per group, the cached block (or None) of each block index
        for g, window in enumerate(self.group_windows):
            blocks: list[int | None] = []
            for i in range(n):
                blocks.append(self._lookup(g, i, hashes[i], seq))
                if blocks[-1] is None and window is None:
                    n = i
                    break
            found.append(blocks)
        snapshots = self.snapshots
        while (
            n > 0
            and (
                (snapshots is not None and not snapshots.has(hashes[n - 1]))  # a hybrid model's states at its end
                or any(None in found[g][self._window_start(g, n * bs) : n] for g in range(self.num_groups))
            )
        ):
            n -= 1
        tables = tuple(
            tuple(NULL_BLOCK if i < self._window_start(g, n * bs) else found[g][i] for i in range(n))
            for g in range(self.num_groups)
        )
        return PrefixHit(tables, n, self.block_size)

    def _register_full_blocks(self, seq: Sequence) -> None:
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_tables[0]))
        start = self.num_registered.get(seq.seq_id, 0)
        if num_full <= start:  # no block filled since the last call
            return
        hashes = self._hashes(seq, num_full)
        bs = self.block_size
        for g, table in enumerate(seq.block_tables):
            cached = self.cached_by_group[g]
            for i in range(start, num_full):
                block_id = table[i]
                if block_id != NULL_BLOCK and block_id not in self._content and hashes[i] not in cached:
                    self._content[block_id] = (g, hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                    cached[hashes[i]] = block_id
                    if g == 0:
                        self.bloom.add(hashes[i])
        self.num_registered[seq.seq_id] = max(start, num_full)

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens in every group (after taking
        ``hit``, its prefix hit, if any); first, sliding groups give back what their windows no
        longer see. Returns False, taking nothing, if the pool is too small."""
        if hit is None and self._all_full and (self.state_slots is None or seq.state_slot >= 0):
            table = seq.block_tables[0]  # a running sequence whose blocks hold its new tokens: nothing to do
            if table and seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
                return True
        if hit is not None and hit.num_blocks:
            assert not seq.block_table, "a prefix hit only starts a block table"
            num_computed = hit.num_tokens
            tables: Seq[Seq[int]] = hit.tables
        else:
            hit = None
            if len(seq.block_tables) != self.num_groups:
                assert not seq.block_table
            else:
                self._free_out_of_window(seq)
            num_computed = seq.num_computed_tokens
            tables = seq.block_tables if len(seq.block_tables) == self.num_groups else ((),) * self.num_groups
        total_blocks = self.blocks_needed(num_computed + num_new_tokens)
        refs = self._refs
        num_needed = sum(max(0, total_blocks - len(t)) for t in tables)
        if hit is not None:
            num_needed += sum(1 for t in hit.tables for b in t if b != NULL_BLOCK and refs[b] == 0)
        needs_slot = self.state_slots is not None and seq.state_slot < 0
        if (num_needed and num_needed > self.num_free_blocks) or (needs_slot and not self.state_slots.num_free):
            return False
        if needs_slot:
            self.state_slots.take(seq)
            if hit is not None and self.snapshots is not None:  # its states at the hit's end, in this step
                self.snapshots.restore(self.block_hashes[seq.seq_id][hit.num_blocks - 1], seq)
        if len(seq.block_tables) != self.num_groups or hit is not None:
            seq.block_tables = [list(t) for t in tables]
        if hit is not None:
            for block_id in (b for t in hit.tables for b in t if b != NULL_BLOCK):
                if refs[block_id] == 0:
                    del self._free_cached[block_id]
                refs[block_id] += 1
        for table in seq.block_tables:
            for _ in range(total_blocks - len(table)):
                table.append(self._take())
        return True

    def _take(self) -> int:
        """A free block, in hand-out order (the last freed uncached, never used, least recently
        freed cached: evicted)."""
        refs = self._refs
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
        return block_id

    def _free_out_of_window(self, seq: Sequence) -> None:
        """Sliding groups give back blocks before their window (oldest first: evicted first). A table
        changed other than by appending is a new list (``Sequence.block_tables``' contract)."""
        tables = seq.block_tables
        for g, table in enumerate(tables):
            end = min(self._window_start(g, seq.num_computed_tokens), len(table))
            start = end
            while start > 0 and table[start - 1] != NULL_BLOCK:
                start -= 1
            if start == end:
                continue
            if seq.block_tables is tables:
                seq.block_tables = list(tables)
            table = seq.block_tables[g] = list(table)
            for i in range(start, end):
                self._release(table[i])
                table[i] = NULL_BLOCK

    def _release(self, block_id: int) -> None:
        n = self._refs[block_id] - 1
        assert n >= 0
        self._refs[block_id] = n
        if n == 0:
            if block_id in self._content:
                self._free_cached[block_id] = None
            else:
                self._free_uncached.append(block_id)

    def commit_computed(self, seq: Sequence) -> None:
        """Call after a step raised ``seq.num_computed_tokens``: registers newly full blocks."""
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)
            if self.snapshots is not None:
                self.snapshots.commit(seq, self._hashes)

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks; tail blocks first, so they are evicted before the prefix."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_tables = [[]]
        self.num_registered.pop(seq.seq_id, None)
        if self.state_slots is not None:
            self.state_slots.release(seq)
        if self.snapshots is not None:
            self.snapshots.drop(seq)

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence hash state once a sequence is finished for good."""
        self.block_hashes.pop(seq.seq_id, None)
        if self.snapshots is not None:
            self.snapshots.forget(seq)

    def _uncache(self, block_id: int) -> None:
        group, block_hash, _ = self._content.pop(block_id)
        del self.cached_by_group[group][block_hash]
        if group == 0:
            self.bloom.remove(block_hash)

    def reset_prefix_cache(self) -> None:
        """Drops the content of every free cached block; they join the uncached free blocks
        (least recently freed on top)."""
        for block_id in self._free_cached:
            self._uncache(block_id)
        self._free_uncached.extend(reversed(self._free_cached))
        self._free_cached.clear()
        if self.snapshots is not None:
            self.snapshots.reset()

    def digest(self) -> PrefixDigest | None:
        """What the prefix cache holds, for routing; None without prefix caching."""
        if self.bloom is None:
            return None
        return self.bloom.digest(self.snapshots.bloom if self.snapshots is not None else None)

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Every block is either free (ref 0, free once) or referenced exactly as often as it
        appears in live block tables; cached hashes point at their blocks; each state slot and snapshot
        is held once (``block_invariants``). O(blocks used so far)."""
        live = list(live)
        if self.state_slots is not None:
            self.state_slots.check_invariants(live)
        if self.snapshots is not None:
            self.snapshots.check_invariants()
        check_blocks(self, live)
