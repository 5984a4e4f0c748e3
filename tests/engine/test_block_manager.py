"""Property-based tests of the paged KV-cache block manager (no model).

A hypothesis state machine drives one ``BlockManager`` the way the scheduler does: admit
sequences (prefix-cache lookup, then ``allocate`` of a first chunk), compute further chunks,
sample a token whenever a sequence has caught up, preempt (free but keep the hash state),
re-admit, finish, reset the prefix cache. Prompts are a few shared prefixes plus random
suffixes over a 3-token alphabet, so prefix-cache hits, evictions and ``allocate`` failures
are all frequent.

Next to the manager it keeps a model of the KV cache itself (which token each slot of each
block holds, written when a chunk is computed), so it checks not just the bookkeeping but
that a prefix hit hands out blocks that really hold the sequence's tokens, and that no
block is written while it is shared or registered in the cache. The manager has one KV-cache
group or several (full and sliding-window ones, ``kv_cache_interface``): every group's table
must hold the KV its layers attend to, and a sliding group no more than its window spans.
"""

from __future__ import annotations

import copy
import tracemalloc

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cb_serve.engine.block_manager import BlockManager, PrefixHit
from cb_serve.kv_cache_interface import NULL_BLOCK
from cb_serve.prefix_hash import MAX_BITS
from cb_serve.sampling_params import SamplingParams
from cb_serve.sequence import Sequence

ALPHABET = 3
PARAMS = SamplingParams(max_tokens=None)

tokens = st.lists(st.integers(0, ALPHABET - 1), max_size=14)


def next_token(token_ids: list[int]) -> int:
    """A deterministic "greedy model": equal token histories give equal next tokens, so
    sequences with one prompt stay identical and keep hitting each other's cached blocks."""
    return (token_ids[-1] * 2 + len(token_ids)) % ALPHABET


def snapshot(bm: BlockManager, seq: Sequence) -> tuple:
    """Everything ``allocate`` may change (order of the free pool included)."""
    blocks = [(bm.ref_count(b), bm.block_hash(b), bm.block_tokens(b)) for b in range(bm.num_blocks)]
    tables = copy.deepcopy(seq.block_tables)
    return (blocks, list(bm.free_blocks()), copy.deepcopy(bm.cached_by_group), tables, copy.deepcopy(bm.num_registered))


def window_start(bm: BlockManager, group: int, num_tokens: int) -> int:
    """The first block of ``group`` the next token attends to (0: a full-attention group)."""
    w = bm.group_windows[group]
    return 0 if w is None else max(0, num_tokens - w + 1) // bm.block_size


def num_cached(bm: BlockManager) -> int:
    return sum(len(c) for c in bm.cached_by_group)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: dict[str, Sequence] = {}  # hold blocks
        self.parked: dict[str, Sequence] = {}  # preempted or never admitted: no blocks, hash state kept
        self.kv: list[list[int | None]] = []  # the KV cache: token held by each slot of each block
        self.prefixes: list[list[int]] = []
        self.next_id = 0

    # ---- helpers ----------------------------------------------------------------------
    @property
    def manager(self) -> BlockManager:
        assert self.bm is not None
        return self.bm

    def _pick(self, pool: dict[str, Sequence], pick: int) -> Sequence:
        return pool[sorted(pool)[pick % len(pool)]]

    def _compute(self, seq: Sequence, n: int) -> None:
        """What a model step does with ``n`` scheduled tokens, then the engine's bookkeeping."""
        bm = self.manager
        bs = bm.block_size
        assert len(seq.block_table) * bs >= seq.num_computed_tokens + n, "no room allocated for the chunk"
        for table in seq.block_tables:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block_id = table[pos // bs]
                assert block_id != NULL_BLOCK, "a token written out of its window"
                assert bm.ref_count(block_id) == 1, f"block {block_id} is written while shared"
                assert bm.block_hash(block_id) is None, f"block {block_id} is written while registered in the cache"
                self.kv[block_id][pos % bs] = seq.token_ids[pos]
        seq.num_computed_tokens += n
        bm.commit_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:  # caught up: the engine always samples
            seq.append_token(next_token(seq.token_ids), 0.0)

    def _admit(self, seq: Sequence, chunk: int) -> None:
        bm = self.manager
        bs = bm.block_size
        hit = bm.find_cached_prefix(seq)
        n_hit = hit.num_blocks
        assert hit.num_tokens < seq.num_tokens, "a prefix hit must leave the last token to compute"
        for g, table in enumerate(hit.tables):
            assert len(table) == n_hit
            start = window_start(bm, g, hit.num_tokens)
            assert all(b == NULL_BLOCK for b in table[:start]) and NULL_BLOCK not in table[start:]
            for i, block_id in enumerate(table[start:], start):
                expected = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                assert bm.block_group(block_id) == g and bm.cached_by_group[g][bm.block_hash(block_id)] == block_id
                assert bm.block_tokens(block_id) == expected
                assert tuple(self.kv[block_id]) == expected, f"block {block_id} is a hit but holds other KV"
        num_computed = hit.num_tokens
        num_new = 1 + chunk % (seq.num_tokens - num_computed)
        before = snapshot(bm, seq)
        num_cached_before = num_cached(bm)
        uncached_free = sum(1 for b in bm.free_blocks() if bm.block_hash(b) is None)
        if not bm.allocate(seq, num_new, hit):
            assert snapshot(bm, seq) == before, "a failed allocate changed state"
            event("admission: allocate failed")
            self.parked[seq.seq_id] = seq
            return
        hit_blocks = [b for t in hit.tables for b in t if b != NULL_BLOCK]
        if n_hit:
            event("admission: prefix-cache hit")
            if any(bm.ref_count(b) > 1 for b in hit_blocks):
                event("admission: hit on a block in use by another sequence")
            if NULL_BLOCK in {b for t in hit.tables for b in t}:
                event("admission: a sliding group's hit starts at its window")
        assert [t[:n_hit] for t in seq.block_tables] == [list(t) for t in hit.tables]
        assert {len(t) for t in seq.block_tables} == {bm.blocks_needed(num_computed + num_new)}
        num_taken = sum(len(t) - n_hit for t in seq.block_tables)
        num_evicted = num_cached_before - num_cached(bm)
        assert num_evicted == max(0, num_taken - uncached_free), "evicted a cached block while an uncached was free"
        if num_evicted:
            event("admission: evicted cached blocks")
        seq.num_computed_tokens = num_computed
        self.parked.pop(seq.seq_id, None)
        self.live[seq.seq_id] = seq
        self._compute(seq, num_new)

    # ---- rules --------------------------------------------------------------------------
    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 3, 4]),
        prefixes=st.lists(tokens, min_size=1, max_size=3),
        windows=st.sampled_from([(None,), (None,), (None, 3), (None, 5), (4,), (None, 2, 6)]),
    )
    def setup(self, num_blocks: int, block_size: int, prefixes: list[list[int]], windows: tuple) -> None:
        self.bm = BlockManager(num_blocks, block_size, group_windows=windows)
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.prefixes = prefixes

    @rule(prefix=st.integers(0, 2), suffix=tokens, chunk=st.integers(0, 50))
    def admit_new(self, prefix: int, suffix: list[int], chunk: int) -> None:
        prompt = self.prefixes[prefix % len(self.prefixes)] + suffix
        if not prompt:
            prompt = [0]
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        self._admit(Sequence(seq_id, seq_id, 0, prompt, PARAMS, max_tokens=1000), chunk)

    @precondition(lambda self: self.parked)
    @rule(pick=st.integers(0, 100), chunk=st.integers(0, 50))
    def readmit(self, pick: int, chunk: int) -> None:
        self._admit(self._pick(self.parked, pick), chunk)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), chunk=st.integers(0, 50), settle=st.booleans())
    def step(self, pick: int, chunk: int, settle: bool) -> None:
        bm = self.manager
        seq = self._pick(self.live, pick)
        n = 1 + chunk % seq.num_uncomputed_tokens
        old_len = len(seq.block_table)
        if settle:  # sliding groups give back what their windows no longer see (allocate does it first)
            assert bm.allocate(seq, 0)
        before = snapshot(bm, seq)
        old_tables = copy.deepcopy(seq.block_tables)
        if not bm.allocate(seq, n):
            if settle:
                assert snapshot(bm, seq) == before, "a failed allocate changed state"
            else:  # it may only have given back blocks out of a window
                for g, (old, new) in enumerate(zip(old_tables, seq.block_tables)):
                    start = window_start(bm, g, seq.num_computed_tokens)
                    assert new == [NULL_BLOCK] * start + old[start:] or new == old
            event("step: allocate failed")
            return
        assert len(seq.block_table) == max(old_len, bm.blocks_needed(seq.num_computed_tokens + n))
        for g, w in enumerate(bm.group_windows):  # a sliding group holds only its window and the chunk
            live = len(seq.block_tables[g]) - seq.block_tables[g].count(NULL_BLOCK)
            if w is not None:
                assert live <= (w + n - 2) // bm.block_size + 2, (w, n, seq.block_tables[g])
                if live < len(seq.block_tables[g]):
                    event("step: a sliding group freed blocks out of its window")
        self._compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def preempt(self, pick: int) -> None:
        seq = self.live.pop(self._pick(self.live, pick).seq_id)
        self.manager.free(seq)
        assert seq.block_table == []
        seq.num_computed_tokens = 0
        self.parked[seq.seq_id] = seq

    @precondition(lambda self: self.live or self.parked)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick: int) -> None:
        pool = {**self.live, **self.parked}
        seq = self._pick(pool, pick)
        self.live.pop(seq.seq_id, None)
        self.parked.pop(seq.seq_id, None)
        self.manager.free(seq)
        self.manager.forget(seq)

    @rule()
    def reset_prefix_cache(self) -> None:
        bm = self.manager
        bm.reset_prefix_cache()
        assert all(bm.block_hash(b) is None for b in bm.free_blocks())
        assert all(bm.ref_count(b) > 0 for b in bm.cached_blocks())

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if self.bm is None:
            return
        bm = self.bm
        bs = bm.block_size
        bm.check_invariants([*self.live.values(), *self.parked.values()])
        owners: dict[int, int] = {}
        for seq in self.live.values():
            assert len(seq.block_table) * bs >= seq.num_computed_tokens
            for g, table in enumerate(seq.block_tables):
                live = [b for b in table if b != NULL_BLOCK]
                assert len(set(live)) == len(live), f"a block twice in {seq}"
                for block_id in live:
                    owners[block_id] = owners.get(block_id, 0) + 1
                # the KV this group's layers attend to is the sequence's own
                for pos in range(window_start(bm, g, seq.num_computed_tokens) * bs, seq.num_computed_tokens):
                    block_id = table[pos // bs]
                    assert block_id != NULL_BLOCK, (seq, g, pos)
                    assert self.kv[block_id][pos % bs] == seq.token_ids[pos], (seq, g, pos)
        for seq in self.parked.values():
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for block_id, n in owners.items():
            assert bm.ref_count(block_id) == n
            if n > 1:
                assert bm.block_hash(block_id) is not None, f"block {block_id} shared by {n} sequences but not cached"
        for block_id in range(bm.num_blocks):
            assert bm.ref_count(block_id) <= 1 or bm.block_hash(block_id) is not None
        assert bm.num_used_blocks == len(owners)
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
        for g, cached in enumerate(bm.cached_by_group):
            for h, block_id in cached.items():
                assert bm.block_hash(block_id) == h and len(bm.block_tokens(block_id)) == bs
                assert bm.block_group(block_id) == g
                assert tuple(self.kv[block_id]) == bm.block_tokens(block_id), f"cached block {block_id} lost its tokens"
        free_hashed = [bm.block_hash(b) is not None for b in bm.free_blocks()]
        assert free_hashed == sorted(free_hashed), "an uncached free block waits behind a cached one"

    def teardown(self) -> None:
        if self.bm is None:
            return
        bm = self.bm
        for seq in [*self.live.values(), *self.parked.values()]:
            bm.free(seq)
            bm.forget(seq)
        self.live.clear()
        self.parked.clear()
        bm.check_invariants([])
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
        assert bm.block_hashes == {} and bm.num_registered == {}, "per-sequence state leaked"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def make_seq(seq_id: str, prompt: list[int]) -> Sequence:
    return Sequence(seq_id, seq_id, 0, prompt, PARAMS, max_tokens=1000)


def compute_and_release(bm: BlockManager, seq: Sequence, chunks: list[int]) -> list[int]:
    """Computes ``seq`` in steps of ``chunks`` tokens (registering full blocks after each), then
    frees it; returns the block table it had."""
    for n in chunks:
        assert bm.allocate(seq, n)
        seq.num_computed_tokens += n
        bm.commit_computed(seq)
    table = list(seq.block_table)
    bm.free(seq)
    bm.forget(seq)
    return table


def test_prefix_hit_reuses_computed_blocks_and_survives_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq("a", [0, 1, 2, 0, 1])
    assert bm.find_cached_prefix(a).blocks == []
    table = compute_and_release(bm, a, [5])
    assert bm.num_used_blocks == 0 and len(bm.cached) == 2  # two full blocks stay cached while free

    b = make_seq("b", [0, 1, 2, 0, 2, 2])
    hit = bm.find_cached_prefix(b)
    assert hit.blocks == table[:2]
    assert bm.allocate(b, 2, hit)
    assert b.block_table[:2] == hit.blocks and bm.num_used_blocks == 3
    bm.check_invariants([b])

    c = make_seq("c", [2, 2, 2, 2, 2, 2, 2])  # needs 4 blocks: only 1 is free
    assert not bm.allocate(c, 7)
    assert bm.allocate(c, 2)  # takes the uncached free block
    assert len(bm.cached) == 2 and bm.num_evictions == 0
    bm.free(b)
    bm.forget(b)
    assert bm.allocate(c, 7)  # now the cached blocks must be evicted for c
    assert bm.cached == {} and bm.num_evictions == 2
    bm.free(c)
    bm.forget(c)
    assert bm.num_used_blocks == 0


def test_blocks_registered_over_several_steps_all_hit() -> None:
    """A prompt computed in chunks registers its full blocks step by step; a later identical
    prompt of ``4 * block + 1`` tokens reuses all 4 (the last token is always computed)."""
    bm = BlockManager(num_blocks=12, block_size=2)
    prompt = [0, 1, 2, 0, 1, 2, 2, 1, 0]
    table = compute_and_release(bm, make_seq("a", prompt), [3, 6])
    b = make_seq("b", list(prompt))
    assert bm.find_cached_prefix(b).blocks == table[:4]


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_seq("a", [0, 1, 2, 0, 1])
    assert bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.commit_computed(a)
    assert bm.cached == {}
    bm.free(a)
    assert bm.find_cached_prefix(make_seq("b", [0, 1, 2, 0, 1])).num_blocks == 0


def test_prefix_hit_never_covers_the_whole_sequence() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq("a", [1, 2, 3, 4])
    assert bm.allocate(seq, 4)
    seq.num_computed_tokens = 4  # caught up at a block boundary: both blocks registered
    bm.commit_computed(seq)
    bm.free(seq)  # e.g. preempted before its next token was appended
    seq.num_computed_tokens = 0
    hit = bm.find_cached_prefix(seq)
    assert hit.num_tokens < seq.num_tokens  # fails: hit == [0, 1], 4 of 4 tokens


def test_allocation_order() -> None:
    """Uncached free blocks go first (the last freed first, then never-used ones by id), then
    cached ones, least recently freed first; a table is freed tail first, so its prefix is
    evicted last; a prefix hit revives a cached free block wherever it waits."""
    bm = BlockManager(num_blocks=8, block_size=2)
    assert list(bm.free_blocks()) == list(range(8))
    assert compute_and_release(bm, make_seq("a", [1, 2, 3, 4, 5, 6, 7]), [7]) == [0, 1, 2, 3]  # 0-2 cached
    assert list(bm.free_blocks()) == [3, 4, 5, 6, 7, 2, 1, 0] and bm.num_cached_free == 3
    u, v = make_seq("u", [9] * 4), make_seq("v", [8])
    assert bm.allocate(u, 4) and bm.allocate(v, 1)
    assert (u.block_table, v.block_table) == ([3, 4], [5])
    bm.free(u)
    bm.free(v)
    assert list(bm.free_blocks()) == [5, 3, 4, 6, 7, 2, 1, 0]
    b = make_seq("b", [1, 2, 3, 4, 0])
    hit = bm.find_cached_prefix(b)
    assert hit.blocks == [0, 1] and bm.allocate(b, 1, hit) and b.block_table == [0, 1, 5]
    assert list(bm.free_blocks()) == [3, 4, 6, 7, 2] and bm.num_cached_free == 1
    c = make_seq("c", [8] * 10)
    assert bm.allocate(c, 10) and c.block_table == [3, 4, 6, 7, 2]
    assert bm.num_evictions == 1 and bm.block_hash(2) is None and set(bm.cached.values()) == {0, 1}
    assert bm.num_free_blocks == 0 and not bm.allocate(make_seq("d", [7]), 1)
    bm.free(b)
    assert list(bm.free_blocks()) == [5, 1, 0] and bm.num_used_blocks == 5
    bm.check_invariants([c])
    bm.reset_prefix_cache()
    assert bm.cached == {} and bm.num_cached_free == 0 and sorted(bm.free_blocks()) == [0, 1, 5]
    bm.check_invariants([c])


def test_a_huge_cache_is_built_small() -> None:
    """Ten million blocks (a tiny model on a large card): no per-block objects, a capped digest."""
    tracemalloc.start()
    try:
        bm = BlockManager(10_000_000, 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, peak
    assert bm.num_free_blocks == 10_000_000 and bm.digest().num_bits == MAX_BITS
    seq = make_seq("a", list(range(40)))
    assert compute_and_release(bm, seq, [40]) == [0, 1, 2]
    assert bm.num_used_blocks == 0 and bm.num_cached_free == 2 and bm.digest().num_cached_blocks == 2
    assert bm.find_cached_prefix(make_seq("b", list(range(40)))).blocks == [0, 1]
    bm.check_invariants([])


def test_a_sliding_group_frees_what_its_window_no_longer_sees() -> None:
    """A full group and a 4-token window (blocks of 2): while a sequence decodes, the sliding table
    keeps at most the 3 blocks the window spans; the blocks it gave back stay cached, and a prefix
    hit on them takes only the window's blocks before the hit point."""
    bm = BlockManager(num_blocks=40, block_size=2, group_windows=(None, 4))
    seq = make_seq("a", list(range(20)))
    assert bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    bm.commit_computed(seq)
    while seq.num_computed_tokens < 20:
        assert bm.allocate(seq, 1)
        full, sliding = seq.block_tables
        assert NULL_BLOCK not in full and len(full) == len(sliding)
        assert len(sliding) - sliding.count(NULL_BLOCK) <= 3
        assert sliding[: window_start(bm, 1, seq.num_computed_tokens)] == [NULL_BLOCK] * window_start(
            bm, 1, seq.num_computed_tokens
        )
        seq.num_computed_tokens += 1
        bm.commit_computed(seq)
        bm.check_invariants([seq])
    assert bm.num_used_blocks == 10 + 2  # the last step's window: tokens 16-19
    bm.free(seq)
    bm.forget(seq)
    assert bm.num_used_blocks == 0 and len(bm.cached_by_group[1]) == 10  # every full block stayed cached

    hit = bm.find_cached_prefix(make_seq("b", list(range(20)) + [7]))
    assert isinstance(hit, PrefixHit) and hit.num_blocks == 10
    # the next token (20) sees tokens 17-19: blocks 8 and 9
    assert hit.tables[1][:8] == (NULL_BLOCK,) * 8 and NULL_BLOCK not in hit.tables[1][8:]
