"""The Mamba2 mixer of hybrid models (Granite 4 ``granitemoehybrid``), over a ragged batch.

Per token: one projection gives the output gate ``z``, the convolution's input ``[x | B | C]`` and the
step sizes ``dt``; a depthwise causal convolution (kernel ``K``, bias, then SiLU) over ``x | B | C``; the
selective scan (``ssd``) from the sequence's state; an RMSNorm over each group of channels, of
``x * silu(z)`` (the gate first, unlike Gated DeltaNet's); the output projection.

State per sequence (``StateSpec``): the convolution's last ``K`` inputs ``[C, K]`` and the scan's
``[H, P, N]``, float32, in slot ``meta.state_slots[i]``; decode rows step together, rows verifying drafts
step position by position, each prefill chunk runs the chunked scan from where its previous chunk stopped
(``recurrent_rows``).

Tensor parallelism splits the heads (``TensorParallelShard.mamba_heads``): whole B/C groups per rank where
they divide, else the one group on every rank and the norm's sum of squares all-reduced; the output
projection's partial sums are all-reduced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve.attention.base import AttentionMetadata
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard
from cb_serve.kv_cache_interface import StateSpec
from cb_serve.model_executor.layers import ssd
from cb_serve.model_executor.layers.causal_conv import causal_conv, conv_step
from cb_serve.model_executor.layers.checkpoint import materialize
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.recurrent_rows import decode_slots, keep_verify_states, prefill_rows


@dataclass(frozen=True)
class Mamba2Spec:
    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    norm_group_size: int = 0  # the gated norm's group (``intermediate / groups`` of the whole layer)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_groups == 0 and min(self.head_dim, self.state_size, self.chunk_size) > 0
        assert self.norm_group_size > 0, self

    @classmethod
    def from_config(cls, config) -> Mamba2Spec:
        heads, expand = config.mamba_n_heads, config.mamba_expand
        intermediate = int(expand * config.hidden_size)
        head_dim = config.mamba_d_head if isinstance(config.mamba_d_head, int) else intermediate // heads
        assert heads * head_dim == intermediate, (heads, head_dim, intermediate)
        return cls(
            config.hidden_size,
            heads,
            head_dim,
            config.mamba_n_groups,
            config.mamba_d_state,
            config.mamba_d_conv,
            config.mamba_chunk_size,
            config.mamba_conv_bias,
            config.mamba_proj_bias,
            config.rms_norm_eps,
            tuple(config.time_step_limit),
            intermediate // config.mamba_n_groups,
        )

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    def state_spec(self) -> StateSpec:
        return StateSpec((self.conv_dim, self.conv_kernel), (self.num_heads, self.head_dim, self.state_size))


class GroupedGatedRMSNorm(nn.Module):
    """HF's ``GraniteMoeHybridRMSNormGated``: ``x * silu(z)`` in float32, an RMSNorm over each group of
    ``group_size`` channels, cast back, ``* weight``. ``tp``: a group split over the ranks (its sum of
    squares all-reduced); None: each rank holds whole groups."""

    def __init__(self, dim: int, group_size: int, eps: float, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.group_size, self.eps, self.tp = group_size, eps, tp

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) * F.silu(gate.to(torch.float32))
        if self.tp is None:
            groups = h.view(*h.shape[:-1], -1, self.group_size)
            h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        else:
            variance = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / self.group_size
            h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(
        self,
        spec: Mamba2Spec,
        shard: TensorParallelShard | None = None,
        tp: TensorParallelGroup | None = None,
        use_cpu_ops: bool = False,
    ) -> None:
        super().__init__()
        self.full_spec, self.tp, self.use_cpu_ops = spec, tp or TensorParallelGroup.single(), use_cpu_ops
        if shard is not None:
            self.heads, self.groups = shard.mamba_heads(spec.num_heads, spec.num_groups)
        else:
            self.heads, self.groups = range(spec.num_heads), range(spec.num_groups)
        self.spec = s = dataclasses.replace(spec, num_heads=len(self.heads), num_groups=len(self.groups))
        self.in_proj = Linear(s.hidden_size, s.intermediate_size + s.conv_dim + s.num_heads, bias=s.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, s.conv_kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(s.conv_dim), requires_grad=False) if s.conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(s.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(s.num_heads), requires_grad=False)
        split = self.tp if self.tp.size > 1 and spec.num_groups == 1 else None  # the one group over the ranks
        self.norm = GroupedGatedRMSNorm(s.intermediate_size, spec.norm_group_size, s.eps, split)
        self.out_proj = Linear(s.intermediate_size, s.hidden_size, bias=s.proj_bias and self.tp.rank == 0)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        s = self.spec
        conv_states, ssm_states = state
        z, xbc, dt = self.in_proj(x).split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        a = -torch.exp(self.A_log.float())
        out = x.new_empty(x.shape[0], s.intermediate_size)
        n = meta.num_decodes
        if n:
            out[:n] = self._step(slice(0, n), decode_slots(meta), xbc, dt, z, a, state)
        for pos in meta.verify_positions:  # drafts: a decode step per position, each one's state kept
            out[pos.tokens] = self._step(pos.tokens, pos.slots, xbc, dt, z, a, state)
            keep_verify_states(pos, state)
        for rows, slot in prefill_rows(meta):
            conv, conv_states[slot] = causal_conv(xbc[rows], conv_states[slot], self.conv_weight, self.conv_bias)
            h, bc = self._split(conv)
            y, ssm_states[slot] = ssd.chunk_scan(
                h, dt[rows], a, bc[:, 0], bc[:, 1], self.D, self.dt_bias, ssm_states[slot], s.chunk_size, s.dt_limit
            )
            out[rows] = self.norm(y.reshape(y.shape[0], -1), z[rows])  # the chunked scan's float32 output
        return self.tp.all_reduce(self.out_proj(out))

    def _step(self, rows, slots: torch.Tensor, xbc, dt, z, a, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One token of each of ``rows`` (a slice or batch indices) from ``slots``, the states updated in place."""
        conv_states, ssm_states = state
        h, bc = self._split(conv_step(xbc[rows], conv_states, slots, self.conv_weight, self.conv_bias))
        b, c = bc[:, 0], bc[:, 1]
        y = ssd.state_step(h, dt[rows], a, b, c, self.D, self.dt_bias, ssm_states, slots, self.use_cpu_ops)
        return self.norm(y.reshape(y.shape[0], -1), z[rows])  # HF: the decode scan's output in the model's dtype

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[x | B | C]`` -> x ``[T, H, P]`` and ``[T, 2, G, N]`` (B, C)."""
        s = self.spec
        h, bc = conv.split([s.intermediate_size, 2 * s.num_groups * s.state_size], dim=-1)
        return h.reshape(-1, s.num_heads, s.head_dim), bc.reshape(-1, 2, s.num_groups, s.state_size)

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """``prefix``: ``model.layers.{i}.mamba.``; this rank's heads and groups."""
        f, w = self.full_spec, lambda name: materialize(state[prefix + name])
        channels, heads, columns, rows = self._local_rows()
        in_weight = w("in_proj.weight")
        self.in_proj.weight.copy_(in_weight[rows])
        if self.in_proj.bias is not None:
            self.in_proj.bias.copy_(w("in_proj.bias")[rows])
        self.conv_weight.copy_(w("conv1d.weight")[channels, 0])
        if self.conv_bias is not None:
            self.conv_bias.copy_(w("conv1d.bias")[channels])
        for name in ("dt_bias", "A_log", "D"):
            getattr(self, name).copy_(w(name)[heads])
        self.norm.weight.copy_(w("norm.weight")[columns])
        self.out_proj.weight.copy_(w("out_proj.weight")[:, columns])
        if self.out_proj.bias is not None:
            self.out_proj.bias.copy_(w("out_proj.bias"))
        assert in_weight.shape[0] == 2 * f.intermediate_size + 2 * f.num_groups * f.state_size + f.num_heads

    def lora_in_proj(self) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
        """For LoRA (``lora/peft_adapter.py``): ``in_proj`` is one checkpoint projection (gate, conv input, dt)."""
        return (self.in_proj.out_features,), {}

    def _local_rows(self) -> tuple[torch.Tensor, slice, slice, torch.Tensor]:
        """This rank's convolution channels (x of its heads, B and C of its groups), heads, gate/x columns, and
        in_proj rows (``[z | x | B | C | dt]``), in the full layer's order."""
        f = self.full_spec
        heads = slice(self.heads.start, self.heads.stop)
        columns = slice(heads.start * f.head_dim, heads.stop * f.head_dim)
        x = torch.arange(columns.start, columns.stop)
        g = torch.arange(self.groups.start * f.state_size, self.groups.stop * f.state_size)
        channels = torch.cat([x, f.intermediate_size + g, f.intermediate_size + f.num_groups * f.state_size + g])
        dt = torch.arange(heads.start, heads.stop) + f.intermediate_size + f.conv_dim
        return channels, heads, columns, torch.cat([x, f.intermediate_size + channels, dt])
