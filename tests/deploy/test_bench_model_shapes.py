"""The roofline's matmul shapes per token (``cb_serve.benchmarks.model_shapes``): a dense model's projections
and LM head, and a mixture of experts' router and top-k experts in its sparse layers only."""

from __future__ import annotations

from models import tiny_config

from cb_serve.benchmarks.model_shapes import GemmShape, MoELayout, extra_gemm_shape, model_gemm_shapes, moe_layout


def by_name(shapes: list[GemmShape]) -> dict[str, tuple[int, int, int]]:
    return {s.name: (s.k, s.n, s.count_per_token) for s in shapes}


def test_dense_model_shapes():
    config = tiny_config("llama", 100)  # 2 layers, hidden 64, 4 heads / 2 KV heads of 16, intermediate 128
    h, i = config.hidden_size, config.intermediate_size
    assert moe_layout(config) is None
    assert by_name(model_gemm_shapes(config)) == {
        "qkv_proj": (h, 64 + 2 * 32, 2),
        "o_proj": (64, h, 2),
        "gate_up_proj": (h, 2 * i, 2),
        "down_proj": (i, h, 2),
        "lm_head": (h, 100, 1),
    }
    assert extra_gemm_shape(config) == GemmShape("gate_or_up", h, i, 0)


def test_moe_counts_the_router_and_top_k_experts_of_sparse_layers_only():
    # three layers, the middle one dense (mlp_only_layers), 8 experts of 32 columns, top 2
    config = tiny_config("qwen3_moe", 100)
    assert moe_layout(config) == MoELayout(num_experts=8, top_k=2, expert_intermediate=32, sparse_layers=(0, 2))
    h, i = config.hidden_size, config.intermediate_size
    shapes = by_name(model_gemm_shapes(config))
    assert shapes["gate_up_proj"] == (h, 2 * i, 1) and shapes["down_proj"] == (i, h, 1)  # the dense layer
    assert shapes["router"] == (h, 8, 2)
    assert shapes["expert_gate_up"] == (h, 64, 2 * 2) and shapes["expert_down"] == (32, h, 2 * 2)
    assert shapes["qkv_proj"][2] == shapes["o_proj"][2] == 3 and shapes["lm_head"] == (h, 100, 1)
    expert_flop = 2 * 2 * 2 * (h * 64 + 32 * h)  # per token: 2 layers x top 2 x (gate_up + down)
    dense_flop = 2 * (h * 2 * i + i * h)
    flop = sum(s.flop_per_token for s in model_gemm_shapes(config))
    other = 2 * (3 * (h * 128 + 64 * h) + 2 * h * 8 + h * 100)  # attention (4 + 2 + 2 heads of 16), routers, LM head
    assert flop == expert_flop + dense_flop + other
    assert extra_gemm_shape(config) == GemmShape("gate_or_up", h, 32, 0)  # an expert's width


def test_moe_layouts_of_other_configs():
    step = tiny_config("qwen3_moe", 100, mlp_only_layers=[], decoder_sparse_step=2, num_hidden_layers=4)
    assert moe_layout(step).sparse_layers == (1, 3)
    mixtral = tiny_config("mixtral", 100)  # experts as wide as intermediate_size, every layer sparse
    assert moe_layout(mixtral) == MoELayout(8, 2, mixtral.intermediate_size, (0, 1))
    shapes = by_name(model_gemm_shapes(mixtral))
    assert "gate_up_proj" not in shapes and shapes["expert_down"] == (mixtral.intermediate_size, 64, 2 * 2)
