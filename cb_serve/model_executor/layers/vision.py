"""The layers vision towers are made of (SigLIP's now; Qwen3-VL's and Gemma 4's build on them): a
pre-norm transformer block whose attention is bidirectional over one image's patches, and its MLP.

They run PyTorch's own ops in HF's order and shapes (``nn.Linear`` with bias, ``F.layer_norm``,
``F.scaled_dot_product_attention`` on ``[images, heads, patches, head_dim]``), so a tower's float32 outputs
are HF's bit for bit on the same device; images are batched along the first dimension."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve.model_executor.layers.checkpoint import copy_parts

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def load_module(module: nn.Module, state: Mapping, prefix: str) -> None:
    """Every parameter of ``module`` from ``state[prefix + its name]`` (a tower's names are HF's)."""
    for name, parameter in module.named_parameters():
        key = prefix + name
        if key not in state:
            raise ValueError(f"the checkpoint has no {key}")
        copy_parts(parameter, state[key])


class VisionAttention(nn.Module):
    """Multi-head attention over all patches of each image (no mask), q/k/v/out projections with bias."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        assert hidden_size % num_heads == 0, (hidden_size, num_heads)
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1).contiguous())


class VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.act = activation(act)
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """``h = h + attn(ln1(h)); h = h + mlp(ln2(h))`` (SigLIP's and CLIP's encoder layer)."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, act: str, eps: float) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden_size, eps=eps)
        self.self_attn = VisionAttention(hidden_size, num_heads)
        self.layer_norm2 = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = VisionMLP(hidden_size, intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))
