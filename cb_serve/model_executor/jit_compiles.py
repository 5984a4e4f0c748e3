"""How many kernel variants Triton has compiled in this process for cb-serve's own kernels: after
start-up (warm-up and graph capture) the count should stay put, since a live compile stalls the
engine for seconds (``attention/triton_kernels.py`` says which arguments never specialize). Read from
each ``JITFunction``'s per-device cache; only modules already imported are looked at (none on a CPU
engine), and Triton's interpreter compiles nothing."""

from __future__ import annotations

import sys

KERNEL_MODULES = (
    "cb_serve.attention.triton_kernels",
    "cb_serve.model_executor.layers.fused_experts_triton",
    "cb_serve.model_executor.layers.recurrent_triton",
)


def num_triton_compiles() -> int:
    """Compiled variants of every ``@triton.jit`` kernel of ``KERNEL_MODULES``, over all devices."""
    total = 0
    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        for fn in vars(module).values() if module is not None else ():
            caches = getattr(fn, "device_caches", None)  # Triton >= 3.3: device -> (kernel cache, ...)
            if isinstance(caches, dict):
                total += sum(len(entry[0]) for entry in caches.values())
    return total
