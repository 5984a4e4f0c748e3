"""The Gated DeltaNet mixer of Qwen3.5 and Qwen3-Next (HF ``*GatedDeltaNet``), over a ragged batch.

Per token: one projection gives the convolution's input ``[q | k | v]`` (every key head's q, then k,
then every value head's v), the output gate ``z`` and the gates' inputs ``b``, ``a``; a depthwise causal
convolution (kernel ``K``, then SiLU) over ``q | k | v``; the gated delta rule (``delta_rule``) from
the sequence's state; an RMSNorm per value head gated by ``silu(z)``; the output projection.

State per sequence (``StateSpec``): the convolution's last ``K`` inputs ``[C, K]`` and the rule's matrix
``[Hv, Dk, Dv]``, both float32, in slot ``meta.state_slots[i]`` of this layer's state tensors. The
runner zeroes a slot when its sequence starts (HF's zero initial state and zero left padding), so
every row continues from its slot: decode rows (the first ``num_decodes``) in one recurrent step,
rows verifying drafts one recurrent step per position (``recurrent_rows.VerifyPosition``), each prefill
chunk with the chunked rule, exactly where its previous chunk stopped.

Tensor parallelism splits the key heads (``TensorParallelShard.linear_key_heads``), each rank holding their
value heads, their convolution channels and their states; the output projection's partial sums are
all-reduced.

Checkpoints: Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, or Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba`` whose rows are grouped per key head (``[q | k | v | z]`` of the head's
value heads; ``[b | a]``), regrouped here into Qwen3.5's order.
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
from cb_serve.model_executor.layers import delta_rule
from cb_serve.model_executor.layers.causal_conv import causal_conv, conv_step
from cb_serve.model_executor.layers.checkpoint import materialize
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.recurrent_rows import decode_slots, keep_verify_states, prefill_rows


@dataclass(frozen=True)
class DeltaNetSpec:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float

    def __post_init__(self) -> None:
        assert self.num_v_heads % self.num_k_heads == 0 and self.conv_kernel > 0, self

    @classmethod
    def from_config(cls, config) -> DeltaNetSpec:
        return cls(
            config.hidden_size,
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
            config.rms_norm_eps,
        )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_spec(self) -> StateSpec:
        return StateSpec((self.conv_dim, self.conv_kernel), (self.num_v_heads, self.head_k_dim, self.head_v_dim))


class GatedRMSNorm(nn.Module):
    """HF's ``RMSNormGated``: normalize in float32, cast back, ``* weight``, then ``* silu(gate)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        spec: DeltaNetSpec,
        shard: TensorParallelShard | None = None,
        tp: TensorParallelGroup | None = None,
        use_cpu_ops: bool = False,
    ) -> None:
        super().__init__()
        self.full_spec, self.tp, self.use_cpu_ops = spec, tp or TensorParallelGroup.single(), use_cpu_ops
        self.key_heads = shard.linear_key_heads(spec.num_k_heads) if shard else range(spec.num_k_heads)
        ratio = spec.num_v_heads // spec.num_k_heads
        local = len(self.key_heads)
        self.spec = s = dataclasses.replace(spec, num_k_heads=local, num_v_heads=local * ratio)
        self.in_proj = Linear(s.hidden_size, s.conv_dim + s.value_dim + 2 * s.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, s.conv_kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(s.head_v_dim, s.eps)
        self.out_proj = Linear(s.value_dim, s.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        s = self.spec
        conv_states, ssm_states = state
        mixed, z, b, a = self.in_proj(x).split([s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], dim=-1)
        g, beta = delta_rule.gates(a, b, self.A_log, self.dt_bias)
        out = x.new_empty(x.shape[0], s.num_v_heads, s.head_v_dim)
        n = meta.num_decodes
        if n:
            idx = decode_slots(meta)
            q, k, v = self._heads(conv_step(mixed[:n], conv_states, idx, self.conv_weight))
            out[:n] = delta_rule.recurrent_step(q, k, v, g[:n], beta[:n], ssm_states, idx, self.use_cpu_ops)
        for pos in meta.verify_positions:  # drafts: a decode step per position, each one's state kept
            t = pos.tokens
            q, k, v = self._heads(conv_step(mixed[t], conv_states, pos.slots, self.conv_weight))
            out[t] = delta_rule.recurrent_step(q, k, v, g[t], beta[t], ssm_states, pos.slots, self.use_cpu_ops)
            keep_verify_states(pos, state)
        for rows, slot in prefill_rows(meta):
            conv, conv_states[slot] = causal_conv(mixed[rows], conv_states[slot], self.conv_weight)
            q, k, v = self._heads(conv)
            out[rows], ssm_states[slot] = delta_rule.chunk_rule(q, k, v, g[rows], beta[rows], ssm_states[slot])
        out = self.norm(out, z.view(-1, s.num_v_heads, s.head_v_dim))
        return self.tp.all_reduce(self.out_proj(out.reshape(x.shape[0], s.value_dim)))

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        q, k, v = conv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        return (
            q.reshape(-1, s.num_k_heads, s.head_k_dim),
            k.reshape(-1, s.num_k_heads, s.head_k_dim),
            v.reshape(-1, s.num_v_heads, s.head_v_dim),
        )

    @torch.no_grad()
    def load_hf_weights(self, state: Mapping, prefix: str) -> None:
        """``prefix``: ``model.layers.{i}.linear_attn.``; Qwen3.5's or Qwen3-Next's projection layout; this
        rank's key heads and their value heads."""
        f, w = self.full_spec, lambda name: materialize(state[prefix + name])
        if prefix + "in_proj_qkv.weight" in state:
            qkv, z, b, a = (w(f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a"))
        else:
            r, h = f.num_v_heads // f.num_k_heads, f.hidden_size
            qkvz = w("in_proj_qkvz.weight").view(f.num_k_heads, -1, h)
            q, k, v, z = qkvz.split([f.head_k_dim, f.head_k_dim, r * f.head_v_dim, r * f.head_v_dim], dim=1)
            b, a = w("in_proj_ba.weight").view(f.num_k_heads, 2 * r, h).split([r, r], dim=1)
            qkv = torch.cat([t.reshape(-1, h) for t in (q, k, v)])
            z, b, a = (t.reshape(-1, h) for t in (z, b, a))
        channels, heads, columns = self._local_rows()
        self.in_proj.weight.copy_(torch.cat([qkv[channels], z[columns], b[heads], a[heads]]))
        self.conv_weight.copy_(w("conv1d.weight")[channels, 0])
        self.dt_bias.copy_(w("dt_bias")[heads])
        self.A_log.copy_(w("A_log")[heads])
        self.norm.weight.copy_(w("norm.weight"))
        self.out_proj.weight.copy_(w("out_proj.weight")[:, columns])

    def lora_in_proj(self) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
        """For LoRA (``lora/peft_adapter.py``, one rank): ``in_proj``'s parts in Qwen3.5's order (``in_proj_qkv``,
        ``_z``, ``_b``, ``_a``), and the column of each row of Qwen3-Next's per-key-head ``in_proj_qkvz`` and
        ``in_proj_ba`` (the grouping ``load_hf_weights`` undoes)."""
        s = self.spec
        r, dk, dv = s.num_v_heads // s.num_k_heads, s.head_k_dim, s.head_v_dim
        qkvz, ba = [], []
        for h in range(s.num_k_heads):
            v, z = 2 * s.key_dim + h * r * dv, s.conv_dim + h * r * dv
            qkvz += [*range(h * dk, (h + 1) * dk), *range(s.key_dim + h * dk, s.key_dim + (h + 1) * dk)]
            qkvz += [*range(v, v + r * dv), *range(z, z + r * dv)]
            b = s.conv_dim + s.value_dim + h * r
            ba += [*range(b, b + r), *range(b + s.num_v_heads, b + s.num_v_heads + r)]
        parts = (s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads)
        return parts, {"in_proj_qkvz": tuple(qkvz), "in_proj_ba": tuple(ba)}

    def _local_rows(self) -> tuple[torch.Tensor, slice, slice]:
        """This rank's convolution channels (its key heads' q and k, its value heads' v), value heads, and
        value columns, in the full layer's order."""
        f, k = self.full_spec, self.key_heads
        r = f.num_v_heads // f.num_k_heads
        heads = slice(k.start * r, k.stop * r)
        columns = slice(heads.start * f.head_v_dim, heads.stop * f.head_v_dim)
        q = torch.arange(k.start * f.head_k_dim, k.stop * f.head_k_dim)
        v = torch.arange(columns.start, columns.stop) + 2 * f.key_dim
        return torch.cat([q, q + f.key_dim, v]), heads, columns
