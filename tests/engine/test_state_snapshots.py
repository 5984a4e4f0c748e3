"""Recurrent-state snapshots for hybrid models' prefix caching (``engine/state_snapshots.py``), no model.

A hypothesis state machine drives a ``BlockManager`` with state slots and snapshots the way the scheduler
and model runner do: admit (prefix lookup, an aligned first chunk, the step's restores), compute chunks
(the step's saves after the "forward pass"), preempt, finish, reset the cache. Beside it, a model of the
state tensors: each slot holds the tokens its state has consumed. So it checks that a sequence's slot
always holds exactly its computed tokens before each step: a restored snapshot is the state of the hit's
prefix, a save is registered under its own boundary, and no snapshot is handed out while pending. Then
the pieces one by one: chunk alignment, the rolling snapshot, the router digest's boundary bits, sizing.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cb_serve.config import EngineConfig
from cb_serve.engine.block_manager import BlockManager
from cb_serve.engine.state_slots import StateSlots
from cb_serve.engine.state_snapshots import StateSnapshots
from cb_serve.model_executor.cache_tensors import num_state_snapshots
from cb_serve.multimodal.features import MultiModalFeature
from cb_serve.prefix_hash import CountingBloom, prefix_block_hashes
from cb_serve.sampling_params import SamplingParams
from cb_serve.sequence import Sequence

PARAMS = SamplingParams(max_tokens=None)
MAX_SEQS = 3
tokens = st.lists(st.integers(0, 2), max_size=14)


def make_seq(seq_id: str, prompt: list[int]) -> Sequence:
    return Sequence(seq_id, seq_id, 0, prompt, PARAMS, max_tokens=1000)


class SnapshotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.live: dict[str, Sequence] = {}
        self.parked: dict[str, Sequence] = {}
        self.slots: dict[int, tuple[int, ...]] = {}  # the state tensors: tokens each slot has consumed
        self.prefixes: list[list[int]] = []
        self.next_id = 0

    @property
    def snaps(self) -> StateSnapshots:
        assert self.bm is not None and self.bm.snapshots is not None
        return self.bm.snapshots

    def _run_step(self, seq: Sequence, n: int) -> None:
        """One step of ``n`` tokens of ``seq`` as the runner runs it: restores, the forward, saves; then commit."""
        copies = self.snaps.plan_saves([seq], [n])
        for src, dst in copies.restores if copies else ():
            self.slots[dst] = self.slots[src]
            event("a restore")
        if seq.num_computed_tokens == 0:
            self.slots[seq.state_slot] = ()  # the runner zeroes a starting sequence's slot
        assert self.slots.get(seq.state_slot) == tuple(seq.token_ids[: seq.num_computed_tokens]), "a wrong state"
        self.slots[seq.state_slot] = tuple(seq.token_ids[: seq.num_computed_tokens + n])
        for src, dst in copies.saves if copies else ():
            self.slots[dst] = self.slots[src]
        seq.num_computed_tokens += n
        self.bm.commit_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token((seq.token_ids[-1] + len(seq.token_ids)) % 3, 0.0)

    def _admit(self, seq: Sequence, chunk: int) -> None:
        if len(self.live) == MAX_SEQS:
            return
        hit = self.bm.find_cached_prefix(seq)
        num_new = self.snaps.align(seq, hit.num_tokens, 1 + chunk % (seq.num_tokens - hit.num_tokens))
        if not self.bm.allocate(seq, num_new, hit):
            self.parked[seq.seq_id] = seq
            return
        if hit.num_blocks:
            event("a hit")
        seq.num_computed_tokens = hit.num_tokens
        self.parked.pop(seq.seq_id, None)
        self.live[seq.seq_id] = seq
        self._run_step(seq, num_new)

    @initialize(
        num_blocks=st.integers(4, 16),
        block_size=st.sampled_from([1, 2, 3]),
        num_snapshots=st.integers(1, 5),
        prefixes=st.lists(tokens, min_size=1, max_size=3),
    )
    def setup(self, num_blocks: int, block_size: int, num_snapshots: int, prefixes: list[list[int]]) -> None:
        snapshots = StateSnapshots(num_snapshots, MAX_SEQS + 1, block_size)
        self.bm = BlockManager(num_blocks, block_size, True, (None,), StateSlots(MAX_SEQS), snapshots)
        self.prefixes = prefixes

    @rule(prefix=st.integers(0, 2), suffix=tokens, chunk=st.integers(0, 50))
    def admit_new(self, prefix: int, suffix: list[int], chunk: int) -> None:
        prompt = (self.prefixes[prefix % len(self.prefixes)] + suffix) or [0]
        self.next_id += 1
        self._admit(make_seq(f"s{self.next_id}", prompt), chunk)

    @precondition(lambda self: self.parked)
    @rule(pick=st.integers(0, 100), chunk=st.integers(0, 50))
    def readmit(self, pick: int, chunk: int) -> None:
        self._admit(self.parked[sorted(self.parked)[pick % len(self.parked)]], chunk)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), chunk=st.integers(0, 50))
    def step(self, pick: int, chunk: int) -> None:
        seq = self.live[sorted(self.live)[pick % len(self.live)]]
        n = self.snaps.align(seq, seq.num_computed_tokens, 1 + chunk % seq.num_uncomputed_tokens)
        if self.bm.allocate(seq, n):
            self._run_step(seq, n)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), finish=st.booleans())
    def end(self, pick: int, finish: bool) -> None:
        seq = self.live.pop(sorted(self.live)[pick % len(self.live)])
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        if finish:
            self.bm.forget(seq)
        else:
            self.parked[seq.seq_id] = seq

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        assert self.snaps.num_used == 0

    @invariant()
    def consistent(self) -> None:
        if self.bm is None:
            return
        self.bm.check_invariants([*self.live.values(), *self.parked.values()])
        snaps = self.snaps
        for snapshot, block_hash in snaps._hash_of.items():  # every kept state is its boundary's
            held = self.slots[snaps.first_slot + snapshot]
            assert len(held) % self.bm.block_size == 0 and held
            assert prefix_block_hashes([*held, 0], self.bm.block_size)[-1] == block_hash

    def teardown(self) -> None:
        if self.bm is None:
            return
        for seq in [*self.live.values(), *self.parked.values()]:
            self.bm.free(seq)
            self.bm.forget(seq)
        self.bm.check_invariants([])
        assert self.bm.state_slots.num_used == 0 and not self.snaps._pending and not self.snaps._rolling


SnapshotMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSnapshotMachine = SnapshotMachine.TestCase


def test_chunks_end_at_block_boundaries_unless_empty_or_inside_an_image():
    snaps = StateSnapshots(2, 5, 16)
    seq = make_seq("a", list(range(100)))  # its last boundary: 96
    assert snaps.align(seq, 0, 40) == 32, "a chunk the budget cut ends at the last boundary it reaches"
    assert snaps.align(seq, 0, 10) == 10, "a chunk within one block is left whole"
    assert snaps.align(seq, 32, 68) == 64, "the last chunk ends at the prompt's last boundary"
    assert snaps.align(seq, 96, 4) == 4 and snaps.align(seq, 90, 10) == 6
    whole = make_seq("b", list(range(96)))  # a hit of it reaches 80 (never its last token): its state kept there
    assert snaps.align(whole, 0, 96) == 80 and snaps.align(whole, 80, 16) == 16
    image = MultiModalFeature(identifier="ab" * 32, offset=20, length=30, pixel_values=None)
    seq.mm_features = (image,)
    assert snaps.align(seq, 0, 40) == 40, "a cut inside an image's placeholders is not made"


def test_a_decoding_sequence_keeps_one_rolling_snapshot_and_its_prompt_s():
    bs = 4
    snaps = StateSnapshots(4, 3, bs)
    bm = BlockManager(32, bs, True, (None,), StateSlots(2), snaps)
    seq = make_seq("a", list(range(10)))  # the prompt's last full block ends at 8
    assert bm.allocate(seq, 8)
    copies = snaps.plan_saves([seq], [8])
    assert copies.saves == [(seq.state_slot, 3)] and copies.restores == []
    seq.num_computed_tokens = 8
    bm.commit_computed(seq)
    kept = set(snaps._hash_of.values())
    for _ in range(14):  # decode: a boundary every 4 tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(1, 0.0)
        n = seq.num_tokens - seq.num_computed_tokens
        assert bm.allocate(seq, n)
        snaps.plan_saves([seq], [n])
        seq.num_computed_tokens += n
        bm.commit_computed(seq)
    assert snaps.num_used == 2 and kept < set(snaps._hash_of.values()), "the prompt's snapshot and one rolling"
    last = prefix_block_hashes(seq.token_ids[: seq.num_computed_tokens // bs * bs] + [0], bs)[-1]
    assert snaps.has(last), "the rolling snapshot is at the last full block"
    bm.free(seq)
    bm.forget(seq)
    nxt = make_seq("b", seq.token_ids + [7, 7, 7])  # the next turn of the conversation
    hit = bm.find_cached_prefix(nxt)
    assert hit.num_tokens == seq.num_computed_tokens // bs * bs
    assert bm.allocate(nxt, nxt.num_tokens - hit.num_tokens, hit)
    copies = snaps.plan_saves([nxt], [nxt.num_tokens - hit.num_tokens])
    assert copies.restores == [(3 + snaps._by_hash[last], nxt.state_slot)]


def test_the_digest_counts_a_hit_only_up_to_a_kept_boundary():
    bs = 4
    blocks, boundaries = CountingBloom(64, bs), CountingBloom(8, bs)
    hashes = prefix_block_hashes(list(range(33)), bs)  # 8 blocks
    for h in hashes[:6]:
        blocks.add(h)
    joined = b"".join(hashes)
    assert blocks.digest().hit_blocks(joined) == 6, "a model without recurrent layers: the run of blocks"
    assert blocks.digest(boundaries).hit_blocks(joined) == 0, "no state kept: no hit"
    boundaries.add(hashes[2])
    boundaries.add(hashes[7])  # beyond the run of cached blocks: no use
    digest = blocks.digest(boundaries)
    assert digest.hit_blocks(joined) == 3
    assert type(digest).from_dict(digest.to_dict()) == digest


def test_snapshots_are_sized_by_count_memory_or_max_num_seqs():
    assert num_state_snapshots(EngineConfig(max_num_seqs=5), 1000) == 5
    assert num_state_snapshots(EngineConfig(state_snapshot_memory=4500), 1000) == 4
    assert num_state_snapshots(EngineConfig(num_state_snapshots=7, state_snapshot_memory=0), 1000) == 7
    assert num_state_snapshots(EngineConfig(enable_prefix_caching=False), 1000) == 0
    assert num_state_snapshots(EngineConfig(), 0) == 0, "no recurrent layer"


def test_a_boundary_inside_a_verify_window_is_saved_from_its_verify_slot_if_the_draft_is_kept():
    """Speculative decoding: a sequence with 6 tokens computed verifies its 7th token and 3 drafts; block
    boundary 8 falls after window position 1 (the first draft). The save comes from that position's verify
    slot; it is decided once the step's tokens are appended: registered if the draft was kept, freed if not."""
    bs = 4

    def hashes(seq: Sequence, n: int) -> list[bytes]:
        return prefix_block_hashes([*seq.token_ids[: n * bs], 0], bs)

    for accepted in (3, 1, 0):
        snaps = StateSnapshots(2, first_slot=3, block_size=bs)
        seq = make_seq(f"v{accepted}", list(range(10, 17)))  # 7 prompt tokens
        seq.state_slot, seq.num_computed_tokens, seq.spec_token_ids = 1, 6, [20, 21, 22]
        copies = snaps.plan_saves([seq], [4])
        assert copies is not None and not copies.saves and copies.verify_saves == [(1, 1, 3)], copies
        seq.num_computed_tokens += 1  # update_after_step: the drafts are not counted yet
        snaps.commit(seq, hashes)
        assert snaps.num_used == 1 and snaps.bloom.num_entries == 0, "decided before the step's tokens landed"
        for token in [20, 21, 22][:accepted] + [99]:  # the output processor: the kept drafts, the target's token
            seq.token_ids.append(token)
        seq.num_computed_tokens += accepted
        snaps.commit(seq, hashes)
        snaps.check_invariants()
        if accepted >= 1:
            assert snaps.has(hashes(seq, 2)[1]) and snaps.num_used == 1
        else:
            assert snaps.num_used == 0, "a state holding a rejected draft was kept"
