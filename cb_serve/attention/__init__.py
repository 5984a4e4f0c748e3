"""Attention backends behind one interface; ``get_attention_backend`` picks one."""

from __future__ import annotations

import os

import torch

from cb_serve.attention import cpu_backend, flash_backend, triton_backend
from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.attention.cpu_backend import CpuAttentionBackend
from cb_serve.attention.torch_backend import TorchAttentionBackend
from cb_serve.attention.triton_backend import TritonAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttentionBackend",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "get_attention_backend",
]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: on CUDA flash-attn when it imports, else the Triton kernels (with CUDA graphs);
    on CPU the C++ kernel backend when it builds; else the PyTorch backend."""
    if name == "auto":
        if device.type == "cuda":
            name = (
                "flash_attn" if flash_backend.is_available() else "triton" if triton_backend.is_available() else "torch"
            )
        else:
            name = "cpu" if device.type == "cpu" and cpu_backend.is_available() else "torch"
    if name == "flash_attn":
        return flash_backend.FlashAttentionBackend()
    if name == "triton":
        interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if not (triton_backend.is_available() and device.type == "cuda") and not interpreted:
            raise ValueError(
                "attention_backend='triton' needs CUDA and the triton package "
                "(on CPU only under the Triton interpreter, TRITON_INTERPRET=1, for tests)."
            )
        return triton_backend.TritonAttentionBackend()
    if name == "cpu":
        if device.type != "cpu" or not cpu_backend.is_available():
            raise ValueError("attention_backend='cpu' needs a CPU device and a C++ compiler to build its kernel.")
        return CpuAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"Unknown attention backend {name!r}.")
