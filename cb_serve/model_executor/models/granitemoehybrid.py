"""IBM Granite 4 hybrids (``granitemoehybrid``): Mamba2 layers (``layers/mamba2.py``) with an attention
layer every few (``layer_types``), Granite's four multipliers (``granite.py``), and in every layer a
shared MLP plus, where ``num_local_experts`` > 0, experts routed by a softmax over the top-k logits.
Attention without position embedding (``position_embedding_type`` not ``rope``: NoPE) runs with empty
RoPE tables. Follows ``transformers.models.granitemoehybrid.modeling_granitemoehybrid`` op for op."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard, balanced_range
from cb_serve.model_executor.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from cb_serve.model_executor.layers.mlp import GatedMLP, activation_name
from cb_serve.model_executor.layers.moe import FusedMoE, MoESpec
from cb_serve.model_executor.layers.moe_router import RouterSpec
from cb_serve.model_executor.models.granite import GraniteForCausalLM
from cb_serve.model_executor.models.hybrid import HybridForCausalLM
from cb_serve.model_executor.models.state_views import Rows, StateView


class SharedMLPWithExperts(nn.Module):
    """HF's ``experts(x) + shared_mlp(x)`` (the shared MLP alone without experts)."""

    def __init__(self, shared: GatedMLP, experts: FusedMoE | None) -> None:
        super().__init__()
        self.shared_mlp, self.block_sparse_moe = shared, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_sparse_moe is None:
            return self.shared_mlp(x)
        return self.block_sparse_moe(x) + self.shared_mlp(x)


class GraniteMoeHybridForCausalLM(HybridForCausalLM, GraniteForCausalLM):
    mixer_prefix = "mamba."

    def make_mixer(self, index: int) -> nn.Module:
        return Mamba2Mixer(Mamba2Spec.from_config(self.config), self.shard, self.tp, self.use_cpu_ops)

    def make_mlp(self, index: int) -> nn.Module:
        c, shard = self.config, self.shard
        shared = shared_mlp(c, shard, self.tp, self.use_cpu_ops)
        experts = None
        if c.num_local_experts > 0:
            router = RouterSpec(c.num_local_experts, c.num_experts_per_tok, scoring="topk_softmax")
            spec = MoESpec(router, c.intermediate_size, activation_name(c))
            experts = FusedMoE(c.hidden_size, spec, shard, self.tp, self.use_cpu_ops)
        return SharedMLPWithExperts(shared, experts)

    def load_mlp_weights(self, layer: nn.Module, state: Mapping, src: str, dst: str, put) -> None:
        """The shared MLP's ``input_linear`` (gate rows, then up) and ``output_linear``, this rank's columns;
        the experts' ``input_linear`` / ``output_linear`` (``[E, 2I, H]`` / ``[E, H, I]``) and ``router.layer``
        (a checkpoint's names) read as transformers' fused ``experts.gate_up_proj`` / ``down_proj``, ``router``."""
        mlp, shared = layer.mlp, src + "shared_mlp."
        columns, size = mlp.shared_mlp.columns, self.config.shared_intermediate_size
        fused = state[shared + "input_linear.weight"]
        gate, up = Rows(fused, columns.start, columns.stop), Rows(fused, size + columns.start, size + columns.stop)
        put(dst + "mlp.shared_mlp.gate_up_proj.weight", gate[:], up[:])
        down = state[shared + "output_linear.weight"][:, columns.start : columns.stop]
        put(dst + "mlp.shared_mlp.down_proj.weight", down)
        if mlp.block_sparse_moe is not None:  # on disk: Granite's names; in memory: transformers' fused layout
            moe = src + "block_sparse_moe."
            names = {"router.weight": "router.layer.weight", "experts.gate_up_proj": "input_linear.weight"}
            names["experts.down_proj"] = "output_linear.weight"
            view = {moe + ours: state[moe + theirs] for ours, theirs in names.items() if moe + theirs in state}
            mlp.block_sparse_moe.load_hf_weights(StateView(state, view), src)


def shared_mlp(config, shard: TensorParallelShard, tp: TensorParallelGroup, use_cpu_ops: bool) -> GatedMLP:
    """The shared MLP, this rank's run of its ``shared_intermediate_size`` columns (``.columns``)."""
    columns = balanced_range(config.shared_intermediate_size, shard.size, shard.rank)
    mlp = GatedMLP(config, dataclasses.replace(shard, intermediate=columns), tp, use_cpu_ops)
    mlp.columns = columns
    return mlp
