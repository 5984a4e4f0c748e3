"""Attention backends behind one interface; ``get_attention_backend`` picks one."""

from __future__ import annotations

import torch

from cb_serve.attention import cpu_backend, flash_backend
from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.attention.cpu_backend import CpuAttentionBackend
from cb_serve.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttentionBackend",
    "TorchAttentionBackend",
    "get_attention_backend",
]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: flash-attn on CUDA when it imports; on CPU the C++ kernel backend when it
    builds; else the PyTorch backend."""
    if name == "auto":
        if device.type == "cuda":
            name = "flash_attn" if flash_backend.is_available() else "torch"
        else:
            name = "cpu" if device.type == "cpu" and cpu_backend.is_available() else "torch"
    if name == "flash_attn":
        return flash_backend.FlashAttentionBackend()
    if name == "cpu":
        if device.type != "cpu" or not cpu_backend.is_available():
            raise ValueError("attention_backend='cpu' needs a CPU device and a C++ compiler to build its kernel.")
        return CpuAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"Unknown attention backend {name!r}.")
