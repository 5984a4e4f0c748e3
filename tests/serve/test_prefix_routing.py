"""KV-cache-aware routing without Ray (issue 14): the router's block hashes are the engine's,
each replica's ``PrefixDigest`` tracks what its prefix cache holds through caching, eviction and
reset, and the routing policy blends expected hits with load."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import numpy as np
import pytest
from test_block_manager import compute_and_release, make_seq

from cb_serve import PrefixDigest, prefix_block_hashes
from cb_serve.engine.block_manager import BlockManager
from cb_serve.prefix_hash import MAX_BITS, CountingBloom, chain_hash
from cb_serve.serve.request_router import expected_hit_tokens, hit_advantage, order_by_cost
from cb_serve.serve.routing_report import ReplicaReport

BS = 4


def run(bm: BlockManager, seq_id: str, tokens: list[int]) -> None:
    """Computes a prompt in one step and frees it: its full blocks stay cached."""
    compute_and_release(bm, make_seq(seq_id, tokens), [len(tokens)])


def hashes(tokens: list[int]) -> bytes:
    return b"".join(prefix_block_hashes(tokens, BS))


def test_router_hashes_are_the_engine_hashes():
    """The same chained function and block size: what the engine caches is what the router asks for."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    tokens = list(range(100, 118))  # 4 full blocks + 2 tokens
    run(bm, "a", tokens)
    assert set(bm.cached) == set(prefix_block_hashes(tokens, BS))
    assert len(prefix_block_hashes(tokens, BS)) == 4
    assert len(prefix_block_hashes(tokens[:16], BS)) == 3  # never the block holding the last token
    assert prefix_block_hashes(tokens, BS)[1] == chain_hash(chain_hash(None, tokens[:4]), tokens[4:8])


def test_digest_follows_caching_eviction_and_reset():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = list(range(1, 18))  # 4 full blocks
    assert bm.digest().hit_blocks(hashes(a)) == 0
    run(bm, "a", a)
    digest = bm.digest()
    assert digest.num_cached_blocks == 4 and digest.hit_blocks(hashes(a)) == 4
    # A prompt sharing the first two blocks: a run of two, whatever follows.
    b = a[:8] + [999] * 9
    assert digest.hit_blocks(hashes(b)) == 2
    # Another sequence takes 6 of the 8 blocks: uncached ones go first, then the LRU cached ones
    # (the tail of a, freed first), so a keeps its first blocks only.
    run(bm, "c", list(range(500, 523)))
    held = bm.digest().hit_blocks(hashes(a))
    still_cached = next((i for i, h in enumerate(prefix_block_hashes(a, BS)) if h not in bm.cached), 4)
    assert held == still_cached < 4
    bm.check_invariants([])
    bm.reset_prefix_cache()
    assert bm.digest().num_cached_blocks == 0 and bm.digest().hit_blocks(hashes(a)) == 0
    bm.check_invariants([])


def test_digest_is_fixed_size_and_false_positives_are_rare():
    """10 bits per KV block: about 1% false positives with the whole cache cached."""
    num_blocks = 10_000
    bloom = CountingBloom(num_blocks, BS)
    rng = np.random.default_rng(0)
    members = [chain_hash(None, rng.integers(0, 50_000, BS).tolist()) for _ in range(num_blocks)]
    for h in members:
        bloom.add(h)
    digest = bloom.digest()
    assert len(digest.bits) * 8 == bloom.num_bits >= 10 * num_blocks
    assert all(digest.hit_blocks(h) == 1 for h in members[:500])  # no false negatives
    others = [chain_hash(b"x", [i]) for i in range(20_000)]
    false_positives = sum(digest.hit_blocks(h) for h in others) / len(others)
    assert false_positives < 0.02
    for h in members:
        bloom.remove(h)
    assert not bloom.counts.any() and bloom.digest().num_cached_blocks == 0


def test_digest_size_is_capped():
    """A huge cache (millions of blocks) gets a ``MAX_BITS`` filter: the router reads its size."""
    bloom = CountingBloom(100_000_000, BS)
    assert bloom.num_bits == MAX_BITS and bloom.num_bits % 64 == 0
    member = chain_hash(None, [1, 2, 3, 4])
    bloom.add(member)
    digest = PrefixDigest.from_dict(bloom.digest().to_dict())
    assert len(digest.bits) * 8 == MAX_BITS and digest.hit_blocks(member) == 1


def test_digest_round_trips_as_plain_data():
    bloom = CountingBloom(64, BS)
    bloom.add(chain_hash(None, [1, 2, 3, 4]))
    d = bloom.digest()
    assert PrefixDigest.from_dict(d.to_dict()) == d


def test_expected_hit_tokens_needs_the_same_block_size():
    from cb_serve.serve.engine_request import EngineRequest

    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(1, 14))
    run(bm, "a", tokens)
    stats = ReplicaReport(prefix_cache=bm.digest().to_dict())
    request = EngineRequest("r", None, tokens, block_size=BS, block_hashes=hashes(tokens))
    assert expected_hit_tokens(stats, request) == 3 * BS
    other = EngineRequest("r", None, tokens, block_size=8, block_hashes=b"".join(prefix_block_hashes(tokens, 8)))
    assert expected_hit_tokens(stats, other) == 0  # another block size: no claim
    assert expected_hit_tokens(ReplicaReport(prefix_cache=None), request) == 0  # prefix caching off
    assert expected_hit_tokens(stats, None) == 0  # not an EngineRequest


def test_policy_prefers_the_cache_until_load_diverges():
    threshold = 0.1
    # Equal load: the replica holding half a token budget of the prompt wins, always.
    assert {order_by_cost({"a": 0.2, "b": 0.2}, {"b": 0.5}, 1.0, threshold)[0] for _ in range(50)} == {"b"}
    # b holds the prefix but is loaded past the threshold: load wins.
    assert order_by_cost({"a": 0.2, "b": 0.35}, {"b": 0.5}, 1.0, threshold) == ["a", "b"]
    # Within the threshold, a hit outweighs a small load lead.
    assert order_by_cost({"a": 0.2, "b": 0.25}, {"b": 0.5}, 1.0, threshold) == ["b", "a"]
    # prefix_weight 0: load only.
    assert order_by_cost({"a": 0.2, "b": 0.25}, {"b": 0.5}, 0.0, threshold) == ["a", "b"]
    # Equal hits (a hot prefix everyone holds) and equal load: shared at random.
    picks = Counter(order_by_cost({"a": 0.2, "b": 0.2}, {"a": 0.4, "b": 0.4}, 1.0, threshold)[0] for _ in range(400))
    assert picks["a"] > 120 and picks["b"] > 120
    # A session's replica goes first while it is within the threshold, not beyond.
    assert order_by_cost({"a": 0.2, "b": 0.25}, {}, 1.0, threshold, preferred="b")[0] == "b"
    assert order_by_cost({"a": 0.2, "b": 0.5}, {}, 1.0, threshold, preferred="b")[0] == "a"
    assert order_by_cost({}, {}, 1.0, threshold) == []


def test_a_prefix_most_replicas_hold_gives_no_advantage():
    """A system prompt 3 of 4 replicas hold draws nothing (the 4th gets it on first use); a
    conversation's history that one replica holds beyond it does; with 2 replicas, one holder wins."""
    assert hit_advantage({"a": 400, "b": 400, "c": 400, "d": 0}) == {"a": 0, "b": 0, "c": 0, "d": 0}
    assert hit_advantage({"a": 864, "b": 400, "c": 400, "d": 0}) == {"a": 464, "b": 0, "c": 0, "d": 0}
    assert hit_advantage({"a": 400, "b": 400, "c": 0, "d": 0}) == {"a": 400, "b": 400, "c": 0, "d": 0}
    assert hit_advantage({"a": 400, "b": 0}) == {"a": 400, "b": 0}
    assert hit_advantage({"a": 400}) == {"a": 0}  # one replica: nothing to choose
    assert hit_advantage({}) == {}


def test_a_hot_prefix_held_by_one_replica_spreads_once_load_diverges():
    """Simulated burst: every request shares a prefix only replica b holds; each pick adds one
    request of load (as the router's own count of requests sent does)."""
    random.seed(0)
    max_num_seqs, threshold = 16, 0.1
    counts = Counter()
    for _ in range(64):
        loads = {r: counts[r] / max_num_seqs for r in ("a", "b")}
        counts[order_by_cost(loads, {"b": 0.4}, 1.0, threshold)[0]] += 1
    assert abs(counts["a"] - counts["b"]) <= threshold * max_num_seqs + 1


def test_async_engine_publishes_its_digest_after_a_refresh(random_model_dir):
    """The digest is refreshed by the engine thread when asked; a request's prompt blocks show
    up once it ran, and the digest says which block size it is for."""
    from cb_serve import AsyncLLM, EngineConfig, SamplingParams

    engine = AsyncLLM(EngineConfig.from_kwargs(model=str(random_model_dir("llama")), num_gpu_blocks=64))
    try:
        prompt = list(range(10, 10 + 5 * engine.block_size + 3))
        assert engine.get_cache_digest().num_cached_blocks == 0

        async def run() -> None:
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=2), "r1"):
                pass

        asyncio.run(run())
        engine.get_cache_digest()  # asks for a refresh
        for _ in range(100):
            digest = engine.get_cache_digest()
            if digest.num_cached_blocks:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert digest.block_size == engine.block_size
        assert digest.hit_blocks(b"".join(prefix_block_hashes(prompt, engine.block_size))) == 5
    finally:
        engine.shutdown()


def test_prompt_encoder_matches_the_engine(tiny_llm, random_model_dir):
    """The router tokenizes with the engine's own functions: same ids for text and chat."""
    from cb_serve import EngineConfig, PromptEncoder

    encoder = PromptEncoder(EngineConfig.from_kwargs(model=str(random_model_dir("llama"))))
    text = "Paged attention stores the KV cache in fixed-size blocks."
    assert encoder.encode(text) == tiny_llm.engine.processor.process(text, tiny_llm_params()).prompt_token_ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert encoder.encode_chat(messages) == tiny_llm.apply_chat_template(messages)
    with pytest.raises(ValueError, match="empty"):
        encoder.encode("")


def tiny_llm_params():
    from cb_serve import SamplingParams

    return SamplingParams(max_tokens=1)
