"""The KV cache by layer type (``kv_cache_interface``): how layers are grouped, and an engine whose
sliding-window layers give back the blocks their window no longer sees while a long sequence decodes
(the exactness harness checks the same models' outputs against HF under stress settings)."""

from __future__ import annotations

import pytest
import torch

from cb_serve import LLM, SamplingParams
from cb_serve.kv_cache_interface import KVCacheLayout


def gemma3_windows(num_layers: int, window: int = 512, pattern: int = 6) -> list[int | None]:
    """Gemma 3's layer types: every ``pattern``-th layer global, the rest sliding."""
    return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]


def test_gemma3_270m_layers_form_one_full_and_five_sliding_groups() -> None:
    layout = KVCacheLayout.from_windows(gemma3_windows(18))
    assert layout.group_size == 3 and layout.group_windows == (None, 512, 512, 512, 512, 512)
    assert layout.groups[0].layers == (5, 11, 17) and layout.groups[1].layers == (0, 1, 2)
    assert layout.layer_groups[5] == 0 and layout.layer_tensors[11] == 1 and layout.layer_tensors[4] == 1
    # An 8k sequence: 512 blocks of the full group and 33 of each sliding group, 3 layers each,
    # against 512 blocks of 18 layers when every layer keeps every token.
    hybrid = layout.blocks_per_sequence(8192, 16) * layout.group_size
    flat = KVCacheLayout.from_windows(gemma3_windows(18), hybrid=False)
    assert flat.groups[0].layers == tuple(range(18)) and not flat.is_hybrid
    assert hybrid == (512 + 5 * 33) * 3 and flat.blocks_per_sequence(8192, 16) * 18 / hybrid > 4


def test_uneven_kinds_pad_the_last_group() -> None:
    """Gemma 3 1B: 4 global and 22 sliding layers make groups of 4; the last sliding group has 2."""
    layout = KVCacheLayout.from_windows(gemma3_windows(26))
    assert layout.group_size == 4 and len(layout.groups) == 1 + 6
    assert [len(g.layers) for g in layout.groups] == [4, 4, 4, 4, 4, 4, 2]
    one_kind = KVCacheLayout.from_windows([None] * 5)
    assert len(one_kind.groups) == 1 and one_kind.group_size == 5 and one_kind.layer_tensors == (0, 1, 2, 3, 4)


def test_a_sliding_group_holds_its_window_and_the_step_chunk() -> None:
    (group,) = KVCacheLayout.from_windows([40]).groups
    assert group.blocks_for(10, 16) == 1 and group.blocks_for(1000, 16) == (40 - 1) // 16 + 2
    assert group.blocks_for(1000, 16, new_tokens=64) == (40 + 64 - 2) // 16 + 2


@pytest.fixture(scope="module")
def gemma3_dir(random_model_dir):
    return random_model_dir("gemma3_text")  # layer 0 a sliding window of 40, layer 1 global


@pytest.mark.parametrize("hybrid", [True, False], ids=["by-layer-type", "all-global"])
def test_out_of_window_blocks_are_freed_while_a_long_sequence_decodes(gemma3_dir, hybrid) -> None:
    """A 300-token prompt decodes 80 tokens: with the cache by layer type the sliding layer holds
    at most the blocks its 40-token window spans (4 of 16 tokens) beside the global layer's, so the
    pool's use grows by one block per 16 tokens, not two; the outputs are the same either way."""
    bs = 16
    llm = LLM(
        str(gemma3_dir),
        block_size=bs,
        max_model_len=512,
        num_gpu_blocks=200,
        max_num_batched_tokens=128,
        disable_hybrid_kv_cache_manager=not hybrid,
    )
    engine = llm.engine
    prompt = list(range(1000, 1300))
    engine.add_request(
        "long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    )
    used: list[tuple[int, int]] = []  # (tokens computed, blocks in use) after each decode step
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if tokens and engine.has_unfinished_requests():  # its last token is not computed yet
            used.append((len(prompt) + len(tokens) - 1, engine.get_stats().kv_blocks_used))
    assert len(tokens) == 80 and len(used) == 79
    for num_computed, blocks in used[1:]:  # (after the prefill, its last chunk's blocks go at the next step)
        full = -(-num_computed // bs)
        if hybrid:  # the global layer's blocks plus at most the window's
            assert full < blocks <= full + (40 - 1) // bs + 2, (num_computed, blocks)
        else:  # one block of both layers per 16 tokens
            assert blocks == full, (num_computed, blocks)
    assert engine.get_stats().kv_blocks_used == 0, "every block came back"
    llm.engine.check_invariants()
    GREEDY[hybrid] = tokens
    if len(GREEDY) == 2:
        assert GREEDY[True] == GREEDY[False]


GREEDY: dict[bool, list[int]] = {}


def test_sizing_counts_a_block_as_one_page_of_each_layer_of_a_group() -> None:
    """The bytes a block id costs are ``group_size`` layers' pages: Gemma 3 270M's cache by layer
    type gets 6x the blocks of the all-global layout from the same memory, and a max_model_len
    sequence must fit by the layout's arithmetic (a sliding group: its window and one chunk)."""
    from transformers import Gemma3TextConfig

    from cb_serve.config import EngineConfig
    from cb_serve.engine.kv_cache_sizing import kv_cache_bytes_per_block, num_kv_blocks

    hf = Gemma3TextConfig(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256)
    windows = [512 if t == "sliding_attention" else None for t in hf.layer_types]
    hybrid, flat = KVCacheLayout.from_windows(windows), KVCacheLayout.from_windows(windows, hybrid=False)
    page = 2 * 256 * 16 * 4  # K and V of one KV head of 256 for 16 tokens, float32
    assert kv_cache_bytes_per_block(hf, 16, torch.float32, hybrid) == 3 * page
    assert kv_cache_bytes_per_block(hf, 16, torch.float32, flat) == 18 * page
    config = EngineConfig(kv_cache_memory=18 * page * 600, max_num_batched_tokens=512)
    cpu = torch.device("cpu")
    args = (config, hf, 16, 8192, torch.float32, torch.float32, cpu)
    assert num_kv_blocks(*args, 0, hybrid) == 6 * num_kv_blocks(*args, 0, flat) == 3600
    too_small = EngineConfig(kv_cache_memory=3 * page * 600, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="fewer than one"):  # 512 + 5 * 65 blocks > 600
        num_kv_blocks(too_small, *args[1:], 0, hybrid)


def test_the_inspector_map_names_each_blocks_group() -> None:
    from cb_serve.engine.block_manager import BlockManager
    from cb_serve.engine.kv_map import kv_map
    from cb_serve.sequence import Sequence

    bm = BlockManager(16, 4, group_windows=(None, 4))
    seq = Sequence("a", "a", 0, list(range(12)), SamplingParams(max_tokens=4), max_tokens=4)
    assert bm.allocate(seq, 12)
    seq.num_computed_tokens = 12
    bm.commit_computed(seq)
    assert bm.allocate(seq, 0)  # the sliding group gives back blocks 0 and 1 of its table (cached)
    kv = kv_map(bm, [seq], max_cells=64)
    assert kv["kv_groups"] == (None, 4)
    used = {i: c["kv_group"] for i, c in enumerate(kv["cells"]) if c["state"] == "used"}
    assert sorted(used.values()) == [0, 0, 0, 1]
    assert [c["kv_group"] for c in kv["cells"] if c["state"] == "cached"] == [1, 1]
