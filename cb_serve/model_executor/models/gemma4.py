"""Gemma 4 (text, dense): Gemma 3's four-norm layer and scaled embedding, with
- Gemma 4's RMSNorm (the weight itself, no ``1 +``), q/k norms and a v-norm without weight;
- scores scaled by 1.0, one RoPE table per layer type (global layers: ``proportional`` RoPE, a
  table as wide as the head whose unturned dims have cos 1, sin 0);
- layers that differ (``per_layer_config``): global layers have their own head size and KV heads,
  and with ``attention_k_eq_v`` no v projection (V is the K projection's output);
- KV-shared layers (``num_kv_shared_layers``): the last layers project q alone and attend over the
  KV cache of the last earlier layer of their type (``kv_shared_layers``), with a double-wide MLP
  where ``use_double_wide_mlp``;
- per-layer inputs (``hidden_size_per_layer_input``): a per-token embedding of every layer's slice
  plus a projection of the embedding, gated into each layer's output; a learned ``layer_scalar``;
- final logit soft-capping;
- the MoE block (``enable_moe_block``): beside the dense MLP, experts over the layer's input (their own
  pre-norm), routed from it by a router with its own unscaled norm, a learned input scale and a learned
  scale per expert; the MLP's and the experts' outputs each post-normed, then summed.
Follows ``transformers.models.gemma4.modeling_gemma4`` op for op. Not served (refused): bidirectional
attention, and tensor parallelism (``sharding.shard_for``: its layers' heads differ)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.distributed.sharding import single_shard
from cb_serve.model_executor.layers.attention import Attention, AttentionSpec, layer_windows
from cb_serve.model_executor.layers.checkpoint import LazyTensor, copy_parts
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.mlp import ACTIVATIONS, GatedMLP, activation_name
from cb_serve.model_executor.layers.moe import FusedMoE, MoESpec
from cb_serve.model_executor.layers.moe_router import RouterSpec
from cb_serve.model_executor.layers.norm import Gemma4RMSNorm, Gemma4UnscaledRMSNorm
from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan, refuse


class Gemma4Router(nn.Module):
    """Expert logits ``proj(unscaled_norm(h) * scale * hidden ** -0.5)`` (HF's ``Gemma4TextRouter``)."""

    def __init__(self, hidden_size: int, num_experts: int, eps: float) -> None:
        super().__init__()
        self.norm = Gemma4UnscaledRMSNorm(hidden_size, eps)
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.root = hidden_size**-0.5

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(h) * self.scale * self.root)


class Gemma4DecoderLayer(nn.Module):
    """``h += post_attn_norm(attn(input_norm(h))); h += post_ff_norm(ff)`` with ``ff = mlp(pre_ff_norm(h))``, or
    with the MoE block ``post_ff_norm_1(ff) + post_ff_norm_2(experts(pre_ff_norm_2(h)))``; then with per-layer
    inputs ``h += post_pli_norm(proj(act(gate(h)) * per_layer_input))``, and ``h *= layer_scalar``."""

    def __init__(self, config, attention: Attention, mlp: GatedMLP, moe: FusedMoE | None = None) -> None:
        super().__init__()
        hidden, eps, per_layer = config.hidden_size, config.rms_norm_eps, config.hidden_size_per_layer_input
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.moe = moe
        if moe is not None:
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        if per_layer:
            self.act = ACTIVATIONS[activation_name(config)]
            self.per_layer_input_gate = Linear(hidden, per_layer, bias=False)
            self.per_layer_projection = Linear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, per_layer_input: torch.Tensor | None, rope: Rope, kv_cache, meta):
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, kv_cache, meta))
        ff = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(h), router_input=h)
            ff = self.post_feedforward_layernorm_1(ff) + self.post_feedforward_layernorm_2(experts)
        h = h + self.post_feedforward_layernorm(ff)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """Layer ``prefix`` (``model.layers.{i}.``; one rank: no slicing): its own norms, per-layer-input
        projections and scalar by HF's names, the attention and MLP from theirs, the router under ``router.``
        and the experts beside it."""
        for name, child in self.named_children():  # the norms and per-layer-input projections
            if name not in ("self_attn", "mlp", "moe"):
                copy_parts(child.weight, state[f"{prefix}{name}.weight"])
        copy_parts(self.layer_scalar, state[prefix + "layer_scalar"])
        self.self_attn.load_hf_weights(state, prefix + "self_attn.")
        self.mlp.load_hf_weights(state, prefix + "mlp.")
        if self.moe is not None:
            for ours, theirs in (("gate.proj.weight", "proj.weight"), ("gate.scale", "scale")):
                copy_parts(self.moe.get_parameter(ours), state[f"{prefix}router.{theirs}"])
            copy_parts(self.moe.per_expert_scale, state[f"{prefix}router.per_expert_scale"])
            self.moe.load_experts(state, prefix, block=prefix)


def kv_shared_layers(config) -> dict[int, int]:
    """HF's ``kv_sharing_modes``: from ``num_hidden_layers - num_kv_shared_layers`` on, each layer reads the KV
    of the last earlier layer of its type."""
    types, first = config.layer_types, config.num_hidden_layers - (config.num_kv_shared_layers or 0)
    if first <= 0:
        raise ValueError("Gemma 4 with every layer KV-shared (no layer computing a KV cache) is not supported.")
    if missing := set(types[first:]) - set(types[:first]):
        raise ValueError(f"Gemma 4: KV-shared layers of type {sorted(missing)} have no earlier layer of that type.")
    return {i: max(j for j in range(first) if types[j] == types[i]) for i in range(first, len(types))}


class Gemma4ForCausalLM(CausalLM):
    """The plan declares each layer's attention and KV kind (the engine reads them); the layers are Gemma 4's
    own (``make_layer``: each from its per-layer config, with per-layer inputs and the MoE block)."""

    @classmethod
    def plan(cls, config) -> ModelPlan:
        refuse("Gemma 4", config, ("use_bidirectional_attention",))
        tables, shared = tuple(sorted(set(config.layer_types))), kv_shared_layers(config)
        bias = getattr(config, "attention_bias", False)
        specs = [
            AttentionSpec(
                window,
                bias,
                bias,
                qk_norm=Gemma4RMSNorm,
                scale=1.0,
                rope_table=tables.index(kind),
                shares_kv_of=shared.get(i),
                k_eq_v=bool(config.attention_k_eq_v) and kind != "sliding_attention",
                v_norm=Gemma4UnscaledRMSNorm,
            )
            for i, (window, kind) in enumerate(zip(layer_windows(config), config.layer_types))
        ]
        layers = tuple(LayerPlan(spec, norm=Gemma4RMSNorm, placement="sandwich") for spec in specs)
        softcap = getattr(config, "final_logit_softcapping", None) or None
        return ModelPlan(layers, Gemma4RMSNorm, logits_softcap=softcap, rope_layer_types=tables)

    def __init__(self, config, backend: AttentionBackend, *args, **kwargs) -> None:
        super().__init__(config, backend, *args, **kwargs)
        hidden, layers, per_layer = config.hidden_size, config.num_hidden_layers, config.hidden_size_per_layer_input
        self.per_layer_size = per_layer or 0
        if per_layer:
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, layers * per_layer)
            self.per_layer_model_projection = Linear(hidden, layers * per_layer, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(per_layer, config.rms_norm_eps)
        self.rope_widths = {layer.self_attn.rope_table: layer.self_attn.head_dim for layer in self.layers}
        self.narrow_tables: dict = {}  # (table, its storage) -> contiguous narrowed cos/sin, for the C++ RoPE

    def make_layer(self, index: int, layer: LayerPlan, backend: AttentionBackend) -> nn.Module:
        """Layer ``index`` from its own config (head size, KV heads); one rank holds all its heads."""
        config, spec = self.config.per_layer_config[index], layer.mixer
        shard = single_shard(config)
        if spec.shares_kv_of is not None and config.use_double_wide_mlp:
            shard = dataclasses.replace(shard, intermediate=range(2 * config.intermediate_size))
        attention = Attention(config, backend, spec, shard, self.tp)
        mlp = GatedMLP(config, shard, self.tp, self.use_cpu_ops)
        return Gemma4DecoderLayer(config, attention, mlp, self.make_moe(config, shard))

    def make_moe(self, config, shard) -> FusedMoE | None:
        """The layer's MoE block (``enable_moe_block``), or None."""
        if not getattr(config, "enable_moe_block", False):
            return None
        router = RouterSpec(
            config.num_experts, config.top_k_experts, renormalize=True, float32_weights=True, per_expert_scale=True
        )
        spec = MoESpec(router, config.moe_intermediate_size, activation_name(config))
        gate = Gemma4Router(config.hidden_size, config.num_experts, config.rms_norm_eps)
        return FusedMoE(config.hidden_size, spec, shard, self.tp, self.use_cpu_ops, router=gate)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x)
        ropes = [Rope(positions, cos, sin, x.dtype, self.use_cpu_ops) for cos, sin in self.tables()]
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            layer_input = per_layer[:, i] if per_layer is not None else None
            x = layer(x, layer_input, ropes[layer.self_attn.rope_table], kv_cache, meta.for_layer(i))
        return x

    def tables(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each RoPE table cut to its layers' head size (the loader pads them to the widest)."""
        out = []
        for t, (cos, sin) in enumerate(zip(self.rope_cos, self.rope_sin)):
            width = self.rope_widths[t]
            if width < cos.shape[-1]:
                key = (t, cos.data_ptr(), sin.data_ptr())
                if not self.use_cpu_ops:  # Rope gathers rows: a view will do
                    cos, sin = cos[:, :width], sin[:, :width]
                elif key in self.narrow_tables:
                    cos, sin = self.narrow_tables[key]
                else:
                    cos, sin = self.narrow_tables.setdefault(
                        key, (cos[:, :width].contiguous(), sin[:, :width].contiguous())
                    )
            out.append((cos, sin))
        return out

    @staticmethod
    def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
        """HF's ``Gemma4TextScaledWordEmbedding``: times a float32 scale cast to the weights' dtype."""
        return x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.scaled(self.embed_tokens(input_ids), self.config.hidden_size**0.5)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """``[T, layers, per_layer]``: HF's ``get_per_layer_inputs`` and ``project_per_layer_inputs``."""
        size = self.per_layer_size
        if not size:
            return None
        shape = (x.shape[0], self.config.num_hidden_layers, size)
        tokens = self.scaled(self.embed_tokens_per_layer(input_ids), size**0.5).reshape(shape)
        projected = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + tokens) * 2.0**-0.5

    @torch.no_grad()
    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor | LazyTensor]) -> None:
        """The base's loading (every layer loads itself), then the per-layer-input embedding and projection."""
        super().load_hf_state_dict(state)
        if self.per_layer_size:
            for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"):
                copy_parts(getattr(self, name).weight, state[f"model.{name}.weight"])
