"""The Gated DeltaNet mixer of Qwen3.5 and Qwen3-Next (HF ``*GatedDeltaNet``), over a ragged batch.

Per token: one projection gives the convolution's input ``[q | k | v]`` (every key head's q, then k,
then every value head's v), the output gate ``z`` and the gates' inputs ``b``, ``a``; a depthwise causal
convolution (kernel ``K``, then SiLU) over ``q | k | v``; the gated delta rule (``delta_rule``) from
the sequence's state; an RMSNorm per value head gated by ``silu(z)``; the output projection.

State per sequence (``StateSpec``): the convolution's last ``K`` inputs ``[C, K]`` and the rule's matrix
``[Hv, Dk, Dv]``, both float32, in slot ``meta.state_slots[i]`` of this layer's state tensors. The
runner zeroes a slot when its sequence starts (HF's zero initial state and zero left padding), so
every row continues from its slot: decode rows (the first ``num_decodes``) in one recurrent step,
each prefill chunk with the chunked rule, exactly where its previous chunk stopped.

Checkpoints: Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, or Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba`` whose rows are grouped per key head (``[q | k | v | z]`` of the head's
value heads; ``[b | a]``), regrouped here into Qwen3.5's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve.attention.base import AttentionMetadata
from cb_serve.kv_cache_interface import StateSpec
from cb_serve.model_executor.layers import delta_rule
from cb_serve.model_executor.linear import Linear


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
    def __init__(self, spec: DeltaNetSpec) -> None:
        super().__init__()
        self.spec = s = spec
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
        slots = meta.state_slot_list
        n = meta.num_decodes
        if n:
            idx = meta.state_slots[:n].long()
            conv, conv_states[idx] = delta_rule.causal_conv_step(mixed[:n], conv_states[idx], self.conv_weight)
            q, k, v = self._heads(conv)
            out[:n], ssm_states[idx] = delta_rule.recurrent_rule(q, k, v, g[:n], beta[:n], ssm_states[idx])
        start = n
        for row in range(n, meta.num_seqs):
            end, slot = start + meta.query_lens[row], slots[row]
            conv, conv_states[slot] = delta_rule.causal_conv(mixed[start:end], conv_states[slot], self.conv_weight)
            q, k, v = self._heads(conv)
            out[start:end], ssm_states[slot] = delta_rule.chunk_rule(
                q, k, v, g[start:end], beta[start:end], ssm_states[slot]
            )
            start = end
        out = self.norm(out, z.view(-1, s.num_v_heads, s.head_v_dim))
        return self.out_proj(out.reshape(x.shape[0], s.value_dim))

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
        """``prefix``: ``model.layers.{i}.linear_attn.``; Qwen3.5's or Qwen3-Next's projection layout."""
        s = self.spec
        if prefix + "in_proj_qkv.weight" in state:
            parts = [state[prefix + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")]
        else:
            r = s.num_v_heads // s.num_k_heads
            qkvz = state[prefix + "in_proj_qkvz.weight"].view(s.num_k_heads, -1, s.hidden_size)
            q, k, v, z = qkvz.split([s.head_k_dim, s.head_k_dim, r * s.head_v_dim, r * s.head_v_dim], dim=1)
            b, a = state[prefix + "in_proj_ba.weight"].view(s.num_k_heads, 2 * r, s.hidden_size).split([r, r], dim=1)
            flat = [t.reshape(-1, s.hidden_size) for t in (q, k, v)]
            parts = [
                torch.cat(flat),
                z.reshape(-1, s.hidden_size),
                b.reshape(-1, s.hidden_size),
                a.reshape(-1, s.hidden_size),
            ]
        self.in_proj.weight.copy_(torch.cat(parts))
        self.conv_weight.copy_(state[prefix + "conv1d.weight"][:, 0])
        self.dt_bias.copy_(state[prefix + "dt_bias"])
        self.A_log.copy_(state[prefix + "A_log"])
        self.norm.weight.copy_(state[prefix + "norm.weight"])
        self.out_proj.weight.copy_(state[prefix + "out_proj.weight"])
