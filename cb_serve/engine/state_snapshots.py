"""Snapshots of recurrent layers' states at block boundaries: prefix caching for hybrid models.

A hybrid model's prefix hit needs, beside the prefix's KV blocks, its recurrent layers' states (conv
window and SSM / delta-rule state, ``kv_cache_interface.StateSpec``) after the prefix's last token: a
state holds the whole history and cannot be rebuilt from KV. So states are copied into a pool of
snapshots, each one a state slot of every recurrent layer's tensors beyond the running slots and the
scratch one (``state_cache.StateCache``), and kept under the chained hash of the block that ends at
that boundary (``prefix_hash.chain_hash``). A new sequence resumes from the longest cached prefix that
has both its KV blocks and a snapshot at its end (``BlockManager.find_cached_prefix``).

Where states are kept (as vLLM's block-aligned mode): at block boundaries only, so the scheduler ends a
prefill chunk at one (``align``), and a decode step that fills a block ends at one. The state at the
prompt's last full block before its last token stays cached (the same prompt again can hit it); every
other boundary's is the sequence's rolling snapshot, which the next one replaces: a preempted sequence
resumes from its last, and a finished request leaves the state at its last full block, where the next
turn of its conversation resumes. A running sequence's rolling snapshot is evicted first (it serves only
a preemption); the rest least recently used first, so finished conversations' states outlive the churn.

Copies run inside the step that makes or reads them, in stream order (``StateCopies``): restores
(snapshot to the sequence's slot) before the forward pass, saves (slot to snapshot) after it. A save is
registered under its hash once its step has run (``commit``: after the step, or at its launch under async
scheduling, as KV blocks are, or when the sequence ends); until then it is pending and never evicted. A
sequence that gives back its blocks without its step having run (an error, a preemption) drops it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from cb_serve.prefix_hash import CountingBloom
from cb_serve.sequence import Sequence


@dataclass
class StateCopies:
    """One step's state copies, as (source slot, destination slot) of every recurrent layer's tensors."""

    restores: list[tuple[int, int]] = field(default_factory=list)  # snapshot -> sequence, before the forward
    saves: list[tuple[int, int]] = field(default_factory=list)  # sequence -> snapshot, after it
    # A row verifying drafts: (its slot, window position j, snapshot slot): the state after its j-th query token,
    # which the runner keeps in a verify slot (``StateCache.verify_slot``); registered only if that token is kept
    verify_saves: list[tuple[int, int, int]] = field(default_factory=list)


class StateSnapshots:
    """``num_snapshots`` snapshots, snapshot ``i`` in state slot ``first_slot + i``."""

    def __init__(self, num_snapshots: int, first_slot: int, block_size: int) -> None:
        assert num_snapshots > 0 and first_slot > 0 and block_size > 0
        self.num_snapshots = num_snapshots
        self.first_slot = first_slot
        self.block_size = block_size
        self._free = list(range(num_snapshots - 1, -1, -1))  # a stack: snapshot 0 handed out first
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered ones, least recently used first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._pending: dict[int | str, tuple[int, int, bool, bool]] = {}  # seq id -> snapshot, tokens, rolling, verify
        self._rolling: dict[int | str, tuple[int, bytes]] = {}  # seq id -> its rolling snapshot and its hash
        self._restores: dict[int | str, tuple[int, int]] = {}  # seq id -> its restore in the step being scheduled
        self.bloom = CountingBloom(num_snapshots, block_size)  # the router's view (``PrefixDigest.boundary_bits``)
        self.num_evictions = 0

    @property
    def num_used(self) -> int:
        """Snapshots registered or being saved."""
        return self.num_snapshots - len(self._free)

    def has(self, block_hash: bytes) -> bool:
        """A snapshot is cached at the end of the block with this chained hash."""
        return block_hash in self._by_hash

    # ---- the scheduler's side -------------------------------------------------------
    def align(self, seq: Sequence, num_computed: int, num_new: int) -> int:
        """``num_new`` cut so that a prefill chunk ends at a block boundary, where its states are kept: a
        chunk the budget cut, at the last boundary it reaches; the last chunk, at the last boundary a prefix
        hit of the known tokens can reach (before the last token) when it crosses one. A chunk that would
        then be empty or split an image is left whole."""
        bs, end = self.block_size, num_computed + num_new
        known = seq.num_tokens + seq.num_pending_tokens
        boundary = (known - 1) // bs * bs if end >= known else end // bs * bs
        if not num_computed < boundary < end or any(f.offset < boundary < f.end for f in seq.mm_features):
            return num_new
        return boundary - num_computed

    def restore(self, block_hash: bytes, seq: Sequence) -> None:
        """``seq`` (holding its slot) resumes from the snapshot under ``block_hash`` in the step scheduled now."""
        snapshot = self._by_hash[block_hash]
        self._lru.move_to_end(snapshot)
        self._restores[seq.seq_id] = (self.first_slot + snapshot, seq.state_slot)

    def plan_saves(self, seqs: list[Sequence], num_scheduled: list[int]) -> StateCopies | None:
        """The step's copies, with a save for each sequence whose scheduled tokens end at a block boundary;
        None when there are none. The prompt's last full block's is kept; any other (a prefill chunk's, a
        decode's) is the sequence's rolling one, each taking the place of the one before."""
        bs, copies = self.block_size, StateCopies()
        for seq, n in zip(seqs, num_scheduled):
            if seq.seq_id in self._restores:
                copies.restores.append(self._restores.pop(seq.seq_id))
            end = seq.num_computed_tokens + n
            drafts = len(seq.spec_token_ids)
            if drafts:  # a verify window: the boundary it crosses, if any (the state after that token)
                end = (seq.num_computed_tokens + n) // bs * bs
                end = end if end > seq.num_computed_tokens else 0
            if not end or end % bs or seq.state_slot < 0 or seq.seq_id in self._pending:  # pending: async, a
                continue  # decode's token still to land
            rolling = end != (seq.num_prompt_tokens - 1) // bs * bs  # the prompt's, as a hit of it can reach
            snapshot = self._take_rolling(seq) if rolling else self._take()
            if snapshot is None:  # every snapshot is being saved: this boundary goes without
                continue
            position = end - seq.num_computed_tokens - 1
            self._pending[seq.seq_id] = (snapshot, end, rolling, drafts > 0)
            if position < drafts:  # a draft's state, kept while verifying
                copies.verify_saves.append((seq.state_slot, position, self.first_slot + snapshot))
            else:
                copies.saves.append((seq.state_slot, self.first_slot + snapshot))
        assert not self._restores, "a restore for a sequence not in the step"
        return copies if copies.restores or copies.saves or copies.verify_saves else None

    # ---- after the step -------------------------------------------------------------
    def commit(self, seq: Sequence, hashes: Callable[[Sequence, int], list[bytes]]) -> None:
        """``seq``'s step has run (``hashes(seq, n)``: its full blocks' chained hashes, at least ``n``): its save is
        registered, once the tokens before it are on the host (async scheduling: a decode's token lands a
        step later); a verify window's once its tokens are appended, and only if the token there was kept."""
        pending = self._pending.get(seq.seq_id)
        if pending is None:
            return
        snapshot, end, rolling, verify = pending
        if verify:  # a verify window's: known once its emitted tokens are appended (one past the computed)
            if seq.num_tokens <= seq.num_computed_tokens:
                return
            if seq.num_computed_tokens < end:  # the draft there was rejected: the state is not its
                del self._pending[seq.seq_id]
                self._free.append(snapshot)
                return
        elif end > seq.num_tokens:
            return
        del self._pending[seq.seq_id]
        num_blocks = end // self.block_size
        block_hash = hashes(seq, num_blocks)[num_blocks - 1]
        if block_hash in self._by_hash:  # the same tokens' states are kept already
            self._free.append(snapshot)
            return
        self._by_hash[block_hash], self._hash_of[snapshot] = snapshot, block_hash
        self._lru[snapshot] = None
        self.bloom.add(block_hash)
        if rolling:  # evicted first while its sequence runs (it serves only a preemption): finished ones' last
            self._rolling[seq.seq_id] = (snapshot, block_hash)  # states, where next turns resume, are kept longer
            self._lru.move_to_end(snapshot, last=False)

    def drop(self, seq: Sequence) -> None:
        """``seq`` gave its blocks back: a save its step may not have made is discarded."""
        self._restores.pop(seq.seq_id, None)
        pending = self._pending.pop(seq.seq_id, None)
        if pending is not None:
            self._free.append(pending[0])

    def forget(self, seq: Sequence) -> None:
        """``seq`` is finished for good: its last state now waits for the next turn of its conversation."""
        rolling = self._rolling.pop(seq.seq_id, None)
        if rolling is not None and self._hash_of.get(rolling[0]) == rolling[1]:
            self._lru.move_to_end(rolling[0])

    def reset(self) -> None:
        """Drops every registered snapshot (``BlockManager.reset_prefix_cache``)."""
        for snapshot in list(self._lru):
            self._evict(snapshot)
            self._free.append(snapshot)

    def _take_rolling(self, seq: Sequence) -> int | None:
        """``seq``'s rolling snapshot, if still its own, for its next one; else a free or least recent one."""
        rolling = self._rolling.pop(seq.seq_id, None)
        if rolling is not None and self._hash_of.get(rolling[0]) == rolling[1]:
            self._evict(rolling[0])
            return rolling[0]
        return self._take()

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        snapshot = next(iter(self._lru))
        self._evict(snapshot)
        self.num_evictions += 1
        return snapshot

    def _evict(self, snapshot: int) -> None:
        del self._lru[snapshot]
        block_hash = self._hash_of.pop(snapshot)
        del self._by_hash[block_hash]
        self.bloom.remove(block_hash)

    def check_invariants(self) -> None:
        """Each snapshot is free, registered or pending, exactly once."""
        pending = [p[0] for p in self._pending.values()]
        every = [*self._free, *self._lru, *pending]
        assert sorted(every) == list(range(self.num_snapshots)), "a snapshot lost or held twice"
        assert set(self._hash_of) == set(self._lru) and len(self._by_hash) == len(self._hash_of)
        assert all(self._by_hash[h] == s for s, h in self._hash_of.items())
        assert self.bloom.num_entries == len(self._by_hash)
