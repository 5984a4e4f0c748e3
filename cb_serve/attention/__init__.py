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
    "auto_backend_name",
    "get_attention_backend",
]


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn 2 refuses others ("only support fp16 and bf16")


def auto_backend_name(device_type: str, triton: bool, cpu: bool) -> str:
    """What ``auto`` picks, from the device and which backends can run here: on CUDA the Triton
    kernels (with CUDA graphs) when triton imports, else the PyTorch backend; on CPU the C++ kernel
    backend when it builds, else the PyTorch backend. flash-attn is opt-in
    (``attention_backend="flash_attn"``): its prebuilt wheels cover few torch and CUDA versions."""
    if device_type == "cuda":
        return "triton" if triton else "torch"
    return "cpu" if device_type == "cpu" and cpu else "torch"


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """The backend ``name`` (``auto``: ``auto_backend_name``) for ``device``; raises when it cannot
    serve ``dtype`` there."""
    if name == "auto":
        if device.type == "cuda":  # (availability asked only where it matters: the CPU one builds kernels)
            name = auto_backend_name("cuda", triton_backend.is_available(), False)
        else:
            name = auto_backend_name(device.type, False, cpu_backend.is_available())
    if name == "flash_attn":
        if dtype not in FLASH_DTYPES:
            raise ValueError(f"attention_backend='flash_attn' needs float16 or bfloat16 weights, got {dtype}.")
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
