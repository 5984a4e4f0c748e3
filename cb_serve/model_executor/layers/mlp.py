"""The gated MLP (``down(act(gate(x)) * up(x))``) with fused gate/up columns; it loads its own weights, this
rank's columns of them, from gate/up projections or a fused one (``load_hf_weights``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.model_executor.layers import fused_triton
from cb_serve.model_executor.layers.checkpoint import Rows, copy_parts
from cb_serve.model_executor.layers.linear import Linear

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
FUSED = {"silu": cpu_ops.silu_and_mul, "gelu_pytorch_tanh": cpu_ops.gelu_tanh_and_mul}  # act(gate) * up in C++


def activation_name(config) -> str:
    """The MLP's activation as the HF config names it (Gemma: ``hidden_activation``)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


class GatedMLP(nn.Module):
    """This rank's intermediate columns (``shard.intermediate`` of ``full_size``, by default the config's
    ``intermediate_size``); the down projection's partial sums are reduced over ranks."""

    def __init__(
        self,
        config,
        shard: TensorParallelShard,
        tp: TensorParallelGroup,
        use_cpu_ops: bool = False,
        full_size: int | None = None,
    ) -> None:
        super().__init__()
        self.columns, self.full_size = shard.intermediate, full_size or config.intermediate_size
        name = activation_name(config)
        if name not in ACTIVATIONS:
            raise ValueError(f"Unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)}).")
        self.act, self.fused = ACTIVATIONS[name], FUSED[name] if use_cpu_ops else None
        self.activation = name
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = len(shard.intermediate)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=bias and shard.is_driver)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gate_up_proj(x)
        if fused_triton.applies(x):  # act(gate) * up in one Triton kernel
            return self.tp.all_reduce(self.down_proj(fused_triton.act_and_mul(x, self.activation)))
        if self.fused is not None:
            return self.tp.all_reduce(self.down_proj(self.fused(x)))
        gate, up = x.split(self.intermediate_size, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act(gate) * up))

    @torch.no_grad()
    def load_hf_weights(
        self, state: Mapping, prefix: str, fused_names: tuple[str, str] = ("gate_up_proj", "down_proj")
    ) -> None:
        """This rank's columns of the MLP under ``prefix`` (``model.layers.{i}.mlp.``): ``gate_proj`` and
        ``up_proj``, or where a checkpoint fuses them, ``fused_names[0]``'s rows ``[gate | up]`` (the down
        projection then named ``fused_names[1]``)."""
        c = slice(self.columns.start, self.columns.stop)
        separate = f"{prefix}gate_proj.weight" in state
        down = "down_proj" if separate else fused_names[1]
        for kind in ("weight", "bias") if self.gate_up_proj.bias is not None else ("weight",):
            if separate:
                gate, up = state[f"{prefix}gate_proj.{kind}"], state[f"{prefix}up_proj.{kind}"]
            else:
                fused, size = state[f"{prefix}{fused_names[0]}.{kind}"], self.full_size
                gate, up = Rows(fused, 0, size), Rows(fused, size, 2 * size)
            copy_parts(getattr(self.gate_up_proj, kind), gate[c], up[c])
        copy_parts(self.down_proj.weight, state[f"{prefix}{down}.weight"][:, c])
        if self.down_proj.bias is not None:  # the driver's alone: added once
            copy_parts(self.down_proj.bias, state[f"{prefix}{down}.bias"])
