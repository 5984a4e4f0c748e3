"""Prefix-cache block hashes, shared by the engine (which caches full KV blocks under them) and
the router (which predicts where a prompt's prefix is cached).

A full block is named by a SHA-256 chained over every token before it, so equal hashes mean
equal prefixes. A replica publishes what it caches as a ``PrefixDigest``: a Bloom filter over
those hashes, ``BITS_PER_BLOCK`` bits per KV block of the replica (about 1% false positives
when the whole cache is full) up to ``MAX_BITS``, whatever it holds, so a report has a fixed
size. Its probes are words of the SHA-256 itself: no second hash function. ``PrefixHit`` is what
the engine's block manager finds under those hashes for a new sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NUM_PROBES = 7  # bit positions per hash: optimal for 10 bits per entry
BITS_PER_BLOCK = 10
# A digest never has more bits than this (a 1 MiB report; 16 MiB of engine-side counters), so a
# huge KV cache (millions of blocks of a small model) neither costs host memory at start-up nor
# ships a huge report every routing period. It still holds about 840k cached blocks at 1% false
# positives; past that the router over-counts a prompt's hit by p / (1 - p) blocks on average
# (p the false-positive rate: a false run must start at the first missing block), which stays
# under one block up to about 2.5M cached blocks (40M tokens at block size 16). Over-counting
# only misguides routing, never what an engine computes.
MAX_BITS = 1 << 23
HASH_BYTES = 32


def chain_hash(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Collision-safe content hash of a full block, chained over its whole prefix (``extra``: what else
    its KV depends on, the identifiers of the images whose placeholders it holds)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        digest.update(b"mm" + extra)
    return digest.digest()


def num_hit_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks a prefix hit can cover: never the last token, which must be
    computed to get the logits of the next."""
    return max(0, (num_tokens - 1) // block_size)


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes | None = None, images: Sequence[Any] = ()
) -> list[bytes]:
    """The chained hashes of the blocks of ``token_ids`` that a prefix hit can cover (``salt``:
    the first block's parent, a LoRA adapter's ``cache_salt``; ``images``: the prompt's
    ``MultiModalFeature``s, whose identifiers join the keys of the blocks they touch)."""
    num_blocks = num_hit_blocks(len(token_ids), block_size)
    extras = block_extra_keys(images, block_size, num_blocks) if images else [b""] * num_blocks
    hashes: list[bytes] = []
    for i in range(num_blocks):
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(chain_hash(hashes[-1] if hashes else salt, tokens, extras[i]))
    return hashes


def block_extra_keys(features: Sequence[Any], block_size: int, num_blocks: int) -> list[bytes]:
    """Per full block, the identifiers of the images whose placeholders it holds (b"" for none): a part of
    its prefix-cache hash, as placeholder token ids are the same for every image."""
    keys = [b""] * num_blocks
    for f in features:
        first, last = f.offset // block_size, (f.end - 1) // block_size
        for b in range(first, min(last, num_blocks - 1) + 1):
            keys[b] += bytes.fromhex(f.identifier)
    return keys


def probe_words(hashes: bytes) -> np.ndarray:
    """``[num_hashes, NUM_PROBES]`` uint32 words of concatenated 32-byte hashes."""
    return np.frombuffer(hashes, dtype="<u4").reshape(-1, HASH_BYTES // 4)[:, :NUM_PROBES]


def bloom_holds(bits: bytes, num_bits: int, hashes: bytes) -> np.ndarray:
    """Per hash of ``hashes`` (concatenated), whether a Bloom filter's packed ``bits`` hold it."""
    positions = probe_words(hashes) % np.uint32(num_bits)
    table = np.frombuffer(bits, dtype=np.uint8)
    return ((table[positions >> 3] >> (positions & 7).astype(np.uint8)) & 1).all(axis=1)


@dataclass(frozen=True)
class PrefixDigest:
    """What one replica's prefix cache holds: a Bloom filter over its cached blocks' hashes. A hybrid
    model's adds one over the boundaries where its recurrent states are kept (``boundary_bits``: a hit
    ends at one of those, ``engine/state_snapshots.py``)."""

    block_size: int
    num_bits: int
    bits: bytes  # packed, little-endian bit order
    num_cached_blocks: int
    boundary_num_bits: int = 0
    boundary_bits: bytes = b""

    def hit_blocks(self, hashes: bytes) -> int:
        """The longest run of leading blocks of ``hashes`` (concatenated, see
        ``prefix_block_hashes``) that the filter holds, ending at a kept boundary if the replica needs
        one; may over-count by a false positive."""
        if not hashes or self.num_cached_blocks == 0:
            return 0
        held = bloom_holds(self.bits, self.num_bits, hashes)
        run = int(held.size if held.all() else held.argmin())
        if not self.boundary_num_bits or run == 0:
            return run
        kept = np.flatnonzero(bloom_holds(self.boundary_bits, self.boundary_num_bits, hashes[: run * HASH_BYTES]))
        return int(kept[-1]) + 1 if kept.size else 0

    def to_dict(self) -> dict[str, Any]:
        names = ("block_size", "num_bits", "bits", "num_cached_blocks", "boundary_num_bits", "boundary_bits")
        return {k: getattr(self, k) for k in names}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefixDigest:
        boundary = (int(d.get("boundary_num_bits", 0)), bytes(d.get("boundary_bits", b"")))
        return cls(int(d["block_size"]), int(d["num_bits"]), bytes(d["bits"]), int(d["num_cached_blocks"]), *boundary)


class CountingBloom:
    """The engine's side of ``PrefixDigest``: a counter per bit, so evictions can be removed.
    ``BITS_PER_BLOCK`` bits per block of the cache (a multiple of 64), at most ``MAX_BITS``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_bits = min(-(-num_blocks * BITS_PER_BLOCK // 64) * 64, MAX_BITS)
        self.counts = np.zeros(self.num_bits, dtype=np.uint16)
        self.num_entries = 0

    def _positions(self, block_hash: bytes) -> np.ndarray:
        return probe_words(block_hash)[0] % np.uint32(self.num_bits)

    def add(self, block_hash: bytes) -> None:
        self.counts[self._positions(block_hash)] += 1  # a repeated position counts once, on removal too
        self.num_entries += 1

    def remove(self, block_hash: bytes) -> None:
        positions = self._positions(block_hash)
        assert (self.counts[positions] > 0).all()
        self.counts[positions] -= 1
        self.num_entries -= 1

    def packed(self) -> bytes:
        return np.packbits(self.counts > 0, bitorder="little").tobytes()

    def digest(self, boundaries: CountingBloom | None = None) -> PrefixDigest:
        """The router's view (``boundaries``: where a hybrid model's snapshots are kept)."""
        extra = () if boundaries is None else (boundaries.num_bits, boundaries.packed())
        return PrefixDigest(self.block_size, self.num_bits, self.packed(), self.num_entries, *extra)


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix of ``num_blocks`` full blocks: each group's table for it (a sliding group's
    holds ``NULL_BLOCK`` before its window)."""

    tables: tuple[tuple[int, ...], ...]
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks(self) -> list[int]:
        """The first group's blocks."""
        return list(self.tables[0])
