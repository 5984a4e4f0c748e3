"""State slots of recurrent layers (``engine/state_slots.py``): taken with a sequence's first blocks, given
back with its blocks (finish, abort, preemption), refused admission when none is free; the KV layout
leaves recurrent layers out of every group; hybrid models refuse speculation, and keep prefix caching on
only with state snapshots."""

from __future__ import annotations

import pytest
from models import make_random_model

from cb_serve import LLM
from cb_serve.engine.block_manager import BlockManager
from cb_serve.engine.state_slots import StateSlots
from cb_serve.kv_cache_interface import KVCacheLayout, StateSpec
from cb_serve.sampling_params import SamplingParams
from cb_serve.sequence import Sequence


def seq(i: int) -> Sequence:
    return Sequence(f"s{i}", f"s{i}", 0, list(range(20)), SamplingParams(max_tokens=4), max_tokens=4)


def test_slots_go_with_the_blocks():
    slots = StateSlots(2)
    bm = BlockManager(16, 4, enable_prefix_caching=False, state_slots=slots)
    a, b, c = seq(0), seq(1), seq(2)
    assert bm.allocate(a, 8) and bm.allocate(b, 8)
    assert {a.state_slot, b.state_slot} == {0, 1} and slots.num_free == 0
    used = bm.num_used_blocks
    assert not bm.allocate(c, 4) and c.state_slot == -1 and bm.num_used_blocks == used, "admitted without a slot"
    a.num_computed_tokens = 8
    assert bm.allocate(a, 4) and slots.num_used == 2, "a running sequence keeps its slot"
    bm.check_invariants([a, b])
    bm.free(a)  # finish, abort or preemption
    assert a.state_slot == -1 and slots.num_free == 1
    assert bm.allocate(c, 4) and c.state_slot >= 0
    bm.check_invariants([b, c])
    bm.free(b)
    bm.free(c)
    assert slots.num_free == 2 and bm.num_used_blocks == 0


def test_recurrent_layers_keep_no_kv():
    layout = KVCacheLayout.from_windows([None] * 4, state_layers=(0, 2))
    assert [g.layers for g in layout.groups] == [(1, 3)] and layout.state_layers == (0, 2)
    assert StateSpec((128, 4), (4, 16, 32)).bytes_per_slot == (128 * 4 + 4 * 16 * 32) * 4


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, tokenizer):
    return make_random_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5_text", tokenizer)


def test_a_draft_model_with_recurrent_layers_is_refused(hybrid_dir):
    """A hybrid target speculates (``test_hybrid_spec_decode``), but a draft's own states would need rolling back."""
    draft = {"method": "draft_model", "model": str(hybrid_dir), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="draft model .* recurrent layers"):
        LLM(str(hybrid_dir), speculative_config=draft, max_model_len=128)


def test_a_hybrid_model_keeps_state_snapshots_for_prefix_caching_unless_given_none(hybrid_dir, caplog):
    """Prefix caching stays on, with a snapshot per ``max_num_seqs`` by default (``engine/state_snapshots.py``);
    ``num_state_snapshots=0`` turns it off, logged. Slots are reused across more prompts than slots."""
    llm = LLM(str(hybrid_dir), max_num_seqs=3, max_model_len=256)
    try:
        assert llm.engine.config.enable_prefix_caching
        prompts = [list(range(100, 100 + n)) for n in (3, 40, 90, 17, 60)]  # more than max_num_seqs: slots reused
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
        stats = llm.engine.get_stats()
        assert stats.state_slots_total == 3 and stats.state_slots_used == 0
        assert stats.state_snapshots_total == 3 and stats.state_snapshots_used > 0
    finally:
        llm.engine.shutdown()
    llm = LLM(str(hybrid_dir), max_num_seqs=3, max_model_len=256, num_state_snapshots=0)
    try:
        assert not llm.engine.config.enable_prefix_caching
        assert "Prefix caching disabled for qwen3_5_text" in caplog.text
        assert llm.engine.get_stats().state_snapshots_total == 0
    finally:
        llm.engine.shutdown()
