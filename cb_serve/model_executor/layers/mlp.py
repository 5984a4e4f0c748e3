"""The gated MLP (``down(act(gate(x)) * up(x))``) with fused gate/up columns."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.model_executor.layers.linear import Linear

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
FUSED = {"silu": cpu_ops.silu_and_mul, "gelu_pytorch_tanh": cpu_ops.gelu_tanh_and_mul}  # act(gate) * up in C++


def activation_name(config) -> str:
    """The MLP's activation as the HF config names it (Gemma: ``hidden_activation``)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


class GatedMLP(nn.Module):
    """This rank's intermediate columns; the down projection's partial sums are reduced over ranks."""

    def __init__(self, config, shard: TensorParallelShard, tp: TensorParallelGroup, use_cpu_ops: bool = False) -> None:
        super().__init__()
        name = activation_name(config)
        if name not in ACTIVATIONS:
            raise ValueError(f"Unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)}).")
        self.act, self.fused = ACTIVATIONS[name], FUSED[name] if use_cpu_ops else None
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = len(shard.intermediate)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=bias and shard.is_driver)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gate_up_proj(x)
        if self.fused is not None:
            return self.tp.all_reduce(self.down_proj(self.fused(x)))
        gate, up = x.split(self.intermediate_size, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act(gate) * up))
