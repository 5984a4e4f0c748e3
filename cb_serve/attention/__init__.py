"""Attention backends behind one interface; ``get_attention_backend`` picks one."""

from __future__ import annotations

import torch

from cb_serve.attention import flash_backend
from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: flash-attn on CUDA when it imports, else the PyTorch backend."""
    if name == "auto":
        name = "flash_attn" if device.type == "cuda" and flash_backend.is_available() else "torch"
    if name == "flash_attn":
        return flash_backend.FlashAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"Unknown attention backend {name!r}.")
