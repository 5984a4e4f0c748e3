"""The matmuls one token's forward multiplies, from a HF config: what the roofline (``bench/roofline.py``)
times and counts FLOPs over. A mixture of experts (``moe_layout``) multiplies its router and only its
``top_k`` experts per token in each sparse layer; its other layers (if any) run the dense MLP."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmShape:
    name: str
    k: int
    n: int
    count_per_token: int  # how many [1, k] x [k, n] products one token's forward needs

    @property
    def flop_per_token(self) -> int:
        return 2 * self.k * self.n * self.count_per_token


@dataclass(frozen=True)
class MoELayout:
    """A mixture-of-experts config's sparse layers: ``top_k`` of ``num_experts`` experts of width
    ``expert_intermediate`` per token in each of ``sparse_layers`` (decoder layer indices)."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    sparse_layers: tuple[int, ...]


def moe_layout(hf_config) -> MoELayout | None:
    """The config's experts (None for a dense model). Sparse layers as cb-serve's MoE models build them:
    all but Qwen-MoE's ``mlp_only_layers`` and the layers off its ``decoder_sparse_step``; each expert's width
    is ``moe_intermediate_size`` where the config has one (Qwen, OLMoE), else ``intermediate_size`` (Mixtral,
    gpt-oss)."""
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
    if not experts:
        return None
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    width = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    return MoELayout(experts, hf_config.num_experts_per_tok, width, layers)


def model_gemm_shapes(hf_config) -> list[GemmShape]:
    """The matmuls of one token through a Llama-family model (as cb-serve fuses them) plus the LM head; in a
    mixture of experts, per sparse layer the router and ``top_k`` experts' gate/up and down projections."""
    hidden, inter, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    moe = moe_layout(hf_config)
    sparse = len(moe.sparse_layers) if moe else 0
    shapes = [GemmShape("qkv_proj", hidden, q + 2 * kv, layers), GemmShape("o_proj", q, hidden, layers)]
    if layers > sparse:
        shapes += [
            GemmShape("gate_up_proj", hidden, 2 * inter, layers - sparse),
            GemmShape("down_proj", inter, hidden, layers - sparse),
        ]
    if moe and sparse:
        width, k = moe.expert_intermediate, moe.top_k
        shapes += [
            GemmShape("router", hidden, moe.num_experts, sparse),
            GemmShape("expert_gate_up", hidden, 2 * width, sparse * k),
            GemmShape("expert_down", width, hidden, sparse * k),
        ]
    return [*shapes, GemmShape("lm_head", hidden, hf_config.vocab_size, 1)]


def extra_gemm_shape(hf_config) -> GemmShape:
    """A gate or up projection alone (timed beside the model's shapes, counted in no FLOPs): the dense
    MLP's, or a mixture of experts' expert's."""
    moe = moe_layout(hf_config)
    width = moe.expert_intermediate if moe else hf_config.intermediate_size
    return GemmShape("gate_or_up", hf_config.hidden_size, width, 0)
