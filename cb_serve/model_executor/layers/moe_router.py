"""A mixture-of-experts router: which ``top_k`` experts each token goes to, and with what weights.

Two scoring orders cover the architectures served (each op and dtype as HF transformers runs it):
- ``softmax``: a float32 softmax over every expert's logit, then the top k, optionally renormalized to
  sum to one (Mixtral always; Qwen3-MoE and OLMoE by ``norm_topk_prob``);
- ``topk_softmax``: the top k logits (the router has a bias), then a softmax over those k (gpt-oss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax", "topk_softmax")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    bias: bool = False  # the router's linear layer has a bias (gpt-oss)
    float32_weights: bool = False  # the weights stay float32 under a lower-precision model (Mixtral)
    per_expert_scale: bool = False  # each weight then times a learned scale of its expert (Gemma 4)

    def __post_init__(self) -> None:
        assert self.scoring in SCORINGS, self.scoring
        assert 0 < self.top_k <= self.num_experts, (self.top_k, self.num_experts)


def select_experts(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[T, num_experts]`` -> (weights ``[T, top_k]``, expert ids ``[T, top_k]`` int64)."""
    if spec.scoring == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        top /= top.sum(dim=-1, keepdim=True)
    return (top if spec.float32_weights else top.to(logits.dtype)), ids
