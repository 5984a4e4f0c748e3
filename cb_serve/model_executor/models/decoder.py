"""The decoder layer a ``LayerPlan`` builds: its mixer, its feed-forward and its norms, in the plan's placement.

The layers keep the ``(x, residual)`` convention: the hidden state is ``residual + x``; with norms before each
sublayer (``pre``) the add happens inside the next norm (HF: ``h = h + attn(norm(h)); h = h + mlp(norm(h))``),
so the C++ kernel fuses it with the norm. Module names are the checkpoint's (``input_layernorm``,
``self_attn``, ``mlp``, ...): each part loads its own weights (``load_hf_weights``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard, balanced_range
from cb_serve.model_executor.layers.attention import Attention, AttentionSpec
from cb_serve.model_executor.layers.checkpoint import StateView, copy_parts
from cb_serve.model_executor.layers.gated_deltanet import DeltaNetSpec, GatedDeltaNet
from cb_serve.model_executor.layers.mamba2 import Mamba2Mixer
from cb_serve.model_executor.layers.mlp import GatedMLP
from cb_serve.model_executor.layers.moe import FusedMoE
from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.models.plan import DenseMLP, Experts, FeedForward, LayerPlan, SharedMLPAndExperts

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class SharedMLPWithExperts(nn.Module):
    """``experts(x) + shared_mlp(x)`` (the shared MLP alone without experts), ``SharedMLPAndExperts``."""

    def __init__(self, shared: GatedMLP, experts: FusedMoE | None) -> None:
        super().__init__()
        self.shared_mlp, self.block_sparse_moe = shared, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_sparse_moe is None:
            return self.shared_mlp(x)
        return self.block_sparse_moe(x) + self.shared_mlp(x)

    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """The shared MLP's ``input_linear`` (gate rows, then up) and ``output_linear``; the experts'
        ``input_linear`` / ``output_linear`` and ``router.layer``, read as the fused ``experts.gate_up_proj``
        / ``down_proj`` and ``router`` (``prefix``: the layer's)."""
        self.shared_mlp.load_hf_weights(state, prefix + "shared_mlp.", fused_names=("input_linear", "output_linear"))
        if self.block_sparse_moe is not None:
            moe = prefix + "block_sparse_moe."
            names = {"router.weight": "router.layer.weight", "experts.gate_up_proj": "input_linear.weight"}
            names["experts.down_proj"] = "output_linear.weight"
            view = {moe + ours: state[moe + theirs] for ours, theirs in names.items() if moe + theirs in state}
            self.block_sparse_moe.load_hf_weights(StateView(state, view), prefix)


def dense_mlp(config, size: int, shard: TensorParallelShard, tp: TensorParallelGroup, use_cpu_ops: bool) -> GatedMLP:
    """A gated MLP of ``size`` columns, this rank's run of them."""
    columns = balanced_range(size, shard.size, shard.rank)
    return GatedMLP(config, dataclasses.replace(shard, intermediate=columns), tp, use_cpu_ops, full_size=size)


def build_ffn(config, ffn: FeedForward, shard: TensorParallelShard, tp: TensorParallelGroup, use_cpu_ops: bool):
    if isinstance(ffn, DenseMLP):
        return dense_mlp(config, ffn.intermediate_size or config.intermediate_size, shard, tp, use_cpu_ops)
    hidden = config.hidden_size
    if isinstance(ffn, Experts):
        if ffn.shared_expert_size is None:
            return FusedMoE(hidden, ffn.moe, shard, tp, use_cpu_ops)
        shared = dense_mlp(config, ffn.shared_expert_size, shard, tp, use_cpu_ops)
        return FusedMoE(hidden, ffn.moe, shard, tp, use_cpu_ops, shared_expert=shared, shared_columns=shared.columns)
    assert isinstance(ffn, SharedMLPAndExperts), ffn
    experts = None if ffn.moe is None else FusedMoE(hidden, ffn.moe, shard, tp, use_cpu_ops)
    return SharedMLPWithExperts(dense_mlp(config, ffn.shared_size, shard, tp, use_cpu_ops), experts)


def build_mixer(config, plan: LayerPlan, backend: AttentionBackend, shard, tp, use_cpu_ops: bool) -> nn.Module:
    spec = plan.mixer
    if isinstance(spec, AttentionSpec):
        return Attention(config, backend, spec, shard, tp)
    if isinstance(spec, DeltaNetSpec):
        return GatedDeltaNet(spec, shard, tp, use_cpu_ops)
    return Mamba2Mixer(spec, shard, tp, use_cpu_ops)


class DecoderLayer(nn.Module):
    """One planned layer: ``forward(x, residual, rope, cache, meta) -> (x, residual)``; ``cache`` is the
    layer's KV cache (``meta`` for this layer) or, for a recurrent mixer, its ``(conv, ssm)`` states (``meta``
    of the whole step)."""

    def __init__(
        self,
        config,
        plan: LayerPlan,
        backend: AttentionBackend,
        shard: TensorParallelShard,
        tp: TensorParallelGroup,
        use_cpu_ops: bool,
    ) -> None:
        super().__init__()
        self.placement, self.multiplier, self.recurrent = plan.placement, plan.residual_multiplier, plan.recurrent
        self.mixer_prefix = plan.mixer_prefix

        def norm() -> nn.Module:
            return plan.norm(config.hidden_size, config.rms_norm_eps, use_cpu_ops)

        if plan.placement != "post":
            self.input_layernorm = norm()
        mixer = build_mixer(config, plan, backend, shard, tp, use_cpu_ops)
        if self.recurrent:
            self.mixer = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = norm()
        if plan.placement == "sandwich":
            self.pre_feedforward_layernorm = norm()
        self.mlp = build_ffn(config, plan.ffn, shard, tp, use_cpu_ops)
        if plan.placement != "pre":
            self.post_feedforward_layernorm = norm()
        table = None if self.recurrent else plan.mixer.rope_table
        self.rope_table = table or 0  # a layer without RoPE (or a recurrent one) is handed table 0 and skips it

    def mix(self, x: torch.Tensor, rope: Rope, cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.recurrent:
            return self.mixer(x, cache, meta)
        return self.self_attn(x, rope, cache, meta)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, cache, meta: AttentionMetadata):
        if self.placement == "pre":
            if residual is None:
                residual, x = x, self.input_layernorm(x)
            else:
                x, residual = self.input_layernorm(x, residual)
            x = self.mix(x, rope, cache, meta)
            if self.multiplier != 1.0:
                x = x * self.multiplier
            x, residual = self.post_attention_layernorm(x, residual)
            x = self.mlp(x)
            return (x * self.multiplier if self.multiplier != 1.0 else x), residual
        h = x if residual is None else residual + x
        if self.placement == "sandwich":
            h = h + self.post_attention_layernorm(self.mix(self.input_layernorm(h), rope, cache, meta))
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), h
        h = h + self.post_attention_layernorm(self.mix(h, rope, cache, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """This rank's slices of layer ``prefix`` (``model.layers.{i}.``): the norms by their names, then the
        mixer and the feed-forward, each from its own names."""
        for name in NORMS:
            if hasattr(self, name):
                copy_parts(getattr(self, name).weight, state[f"{prefix}{name}.weight"])
        (self.mixer if self.recurrent else self.self_attn).load_hf_weights(state, prefix + self.mixer_prefix)
        if isinstance(self.mlp, GatedMLP):
            self.mlp.load_hf_weights(state, prefix + "mlp.")
        else:  # experts read their block's names from the layer's prefix
            self.mlp.load_hf_weights(state, prefix)
