"""What a loaded model's weights occupy, by the format they are kept in: logged at start-up, in
``EngineStats.weight_bytes`` and ``/metrics`` (``model_weight_bytes``, label ``format``).

Counted: every parameter and every tensor a module keeps beside them (the CPU kernels' packed copies:
``Linear.decode_weight`` and the like, an embedding's low-bit rows), each storage once (tied weights,
views). Not counted: buffers (RoPE tables, which are not weights) and the KV cache."""

from __future__ import annotations

import torch
from torch import nn

# storage dtype -> format label: low-bit groups (``cpu_ops.exact_quant``) are uint8 (4 bits a weight, two to
# a byte) and int8 (8 bits, Q6_K's too), each group with its float32 scales
FORMATS = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.uint8: "q4_groups",
    torch.int8: "q8_groups",
    torch.float8_e4m3fn: "fp8_e4m3",
}
if hasattr(torch, "float4_e2m1fn_x2"):  # torch 2.8 and later
    FORMATS[torch.float4_e2m1fn_x2] = "mxfp4_groups"  # FP4 codes, two to a byte, with a float32 power of two per 32


def _kept_tensors(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s own parameters and the tensors it keeps as plain attributes (packed copies)."""
    own = list(module.parameters(recurse=False))
    return own + [v for v in vars(module).values() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)]


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Bytes of weights resident per format (``FORMATS``' labels, else the dtype's name), largest first."""
    seen: set[tuple[str, int]] = set()
    totals: dict[str, int] = {}
    for module in model.modules():
        for tensor in _kept_tensors(module):
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            label = FORMATS.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
            totals[label] = totals.get(label, 0) + storage.nbytes()
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def describe(totals: dict[str, int]) -> str:
    """``"281.0 MiB (q8_groups 263.7 MiB, q4_groups 16.9 MiB, float32 0.4 MiB)"``."""
    mib = 2.0**20
    parts = ", ".join(f"{label} {n / mib:.1f} MiB" for label, n in totals.items())
    return f"{sum(totals.values()) / mib:.1f} MiB ({parts})"
