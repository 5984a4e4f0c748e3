"""Which CUDA device a host thread works on, for engines on ``cuda:N`` with N != 0.

PyTorch's own ops run on their tensors' device, but two things follow the calling thread's
*current* device instead:

- a Triton kernel launches on the current device and its current stream
  (``JITFunction.run`` takes ``torch.cuda.current_device()`` and that device's stream);
- ``torch.cuda.graph`` without a ``stream`` captures on a side stream made once per process on
  whatever device was current then, so torch ops on another device run eagerly, unrecorded.

The current device is per host thread (the CUDA runtime keeps it per thread), so each thread
that runs the model selects it: ``bind_thread_to_device`` where the thread starts, or
``device_context`` around the work. On CPU neither touches CUDA.
"""

from __future__ import annotations

import contextlib

import torch


def concrete_device(device: torch.device) -> torch.device:
    """``device`` with its index: bare ``cuda`` is the calling thread's current device (where
    tensors made for ``cuda`` land), so resolve it in the thread that built the engine."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` current for the block (restoring the previous one after) on CUDA; a no-op
    elsewhere. Bare ``cuda`` keeps the current device."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def bind_thread_to_device(device: torch.device) -> None:
    """Makes ``device`` the calling thread's current device for good (a thread that only runs
    the engine, from its start); nothing on CPU. Needs an indexed device (``concrete_device``):
    ``torch.cuda.set_device`` refuses bare ``cuda``."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
