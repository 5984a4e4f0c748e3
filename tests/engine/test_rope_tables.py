"""RoPE tables are computed by cb-serve (``layers/rope_tables.py``) and equal, bit for bit in float32, what
transformers' own rotary modules give (``models.hf_rope_tables``): every tiny family of the exactness
harness, each ``rope_type`` on the families that publish it, partial rotary, per-layer-type tables (Gemma 3,
Gemma 4's proportional global layers), M-RoPE at text positions (Qwen3-VL, Qwen3.5), and NoPE."""

from __future__ import annotations

import pytest
import torch
from models import ARCHS, hf_rope_tables, tiny_config

from cb_serve.model_executor.layers.rope_tables import INV_FREQ, RopeSpec, table
from cb_serve.model_executor.loader import model_rope_tables

VOCAB = 32064  # (Phi-3 pads with id 32000; the models are built on the meta device)
POSITIONS = (200, 1500)  # within the tiny configs' 1024 trained positions, and beyond them
MROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}

# rope_type: the family that publishes it, and its parameters (beside rope_theta)
SCALED = {
    "linear": ("llama", {"factor": 4.0}),
    "dynamic": ("qwen2", {"factor": 2.0}),
    "yarn": ("qwen3", {"factor": 4.0, "original_max_position_embeddings": 256}),
    "yarn_mscale": (  # DeepSeek's mscale pair, beta bounds, no truncation
        "mistral",
        {
            "factor": 8.0,
            "original_max_position_embeddings": 128,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
    ),  # fmt: skip
    "yarn_attention_factor": (
        "llama",
        {"factor": 2.0, "original_max_position_embeddings": 512, "attention_factor": 0.9},
    ),
    "llama3": (
        "llama",
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    ),
    "longrope_partial": (
        "phi3",
        {
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.7, 2.2],
            "long_factor": [1.5, 2.5, 4.0, 6.0],
            "original_max_position_embeddings": 300,
        },
    ),  # fmt: skip
    "linear_partial": ("qwen3_next", {"factor": 2.0, "partial_rotary_factor": 0.25}),
}


def assert_tables_equal(config, max_positions: int) -> None:
    ref = hf_rope_tables(config, max_positions)
    cos, sin = model_rope_tables(config, max_positions)
    if ref is None:
        assert cos.shape == sin.shape == (1, max_positions, 0)
        return
    assert cos.shape == ref[0].shape, (cos.shape, ref[0].shape)
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1]), (cos - ref[0]).abs().max()


@pytest.mark.parametrize("max_positions", POSITIONS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_family_s_tables_are_transformers(arch, max_positions):
    assert_tables_equal(tiny_config(arch, VOCAB), max_positions)


@pytest.mark.parametrize("max_positions", POSITIONS)
@pytest.mark.parametrize("case", list(SCALED))
def test_every_rope_type_is_transformers(case, max_positions):
    arch, params = SCALED[case]
    rope_type = case.split("_")[0]
    config = tiny_config(arch, VOCAB, rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **params})
    assert_tables_equal(config, max_positions)


@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_per_layer_type_tables_gemma(theta):
    """Gemma 3 with a scaled global table; Gemma 4 with its proportional global heads at another width."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert_tables_equal(tiny_config("gemma3_text", VOCAB, rope_parameters=rope), 300)
    gemma4 = {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": theta, "factor": 2.0}
    assert_tables_equal(tiny_config("gemma4_text", VOCAB, rope_parameters={**rope, "full_attention": gemma4}), 300)


def test_m_rope_at_text_positions_and_nope():
    """Qwen3-VL's interleaved M-RoPE (a text token's three positions are one), Qwen3.5's partial M-RoPE, and
    a Granite hybrid without position embedding."""
    windows = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    import transformers

    text = {k: v for k, v in tiny_config("qwen3", VOCAB).to_dict().items() if k not in windows}
    assert_tables_equal(transformers.Qwen3VLTextConfig(**{**text, "rope_parameters": MROPE}), 300)
    qwen3_5 = tiny_config("qwen3_5_text", VOCAB, rope_parameters={**MROPE, "partial_rotary_factor": 0.25})
    assert_tables_equal(qwen3_5, 300)
    assert_tables_equal(tiny_config("granitemoehybrid", VOCAB, position_embedding_type="nope"), 300)


def test_an_unknown_rope_type_is_refused_by_name():
    spec = RopeSpec({"rope_type": "spiral", "rope_theta": 1e4}, 16, 1024)
    with pytest.raises(ValueError, match="'spiral' is not supported.*yarn"):
        table(spec, 8)
    assert {"default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"} <= set(INV_FREQ)
