"""How many kernel variants Triton has compiled in this process for cb-serve's own kernels: after
start-up (warm-up and graph capture) the count should stay put, since a live compile stalls the
engine for seconds (``attention/triton_kernels.py`` says which arguments never specialize). Read from
each ``JITFunction``'s per-device cache; only modules already imported are looked at (none on a CPU
engine), and Triton's interpreter compiles nothing."""

from __future__ import annotations

import sys

KERNEL_MODULES = (
    "cb_serve.attention.triton_kernels",
    "cb_serve.attention.triton_rope_kv",
    "cb_serve.model_executor.layers.fused_experts_triton",
    "cb_serve.model_executor.layers.fused_triton",
    "cb_serve.model_executor.layers.recurrent_triton",
)


_kernels: dict[tuple, list] = {}  # the imported modules -> their kernels (found once per set)


def num_triton_compiles() -> int:
    """Compiled variants of every ``@triton.jit`` kernel of ``KERNEL_MODULES``, over all devices."""
    imported = tuple(sys.modules[name] for name in KERNEL_MODULES if name in sys.modules)
    kernels = _kernels.get(imported)
    if kernels is None:  # once per set of imported modules, not per step
        found = (fn for module in imported for fn in vars(module).values())
        kernels = _kernels[imported] = [fn for fn in found if isinstance(getattr(fn, "device_caches", None), dict)]
    # device_caches (Triton >= 3.3): device -> (kernel cache, ...)
    return sum(len(entry[0]) for fn in kernels for entry in fn.device_caches.values())
