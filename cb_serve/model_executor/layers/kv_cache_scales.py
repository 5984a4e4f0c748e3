"""Per-tensor FP8 KV-cache scales (``kv_cache_dtype="fp8"``): a checkpoint calibrated for an FP8 cache (vLLM's
and llm-compressor's ``kv_cache_scheme``) stores one scale for each layer's keys and one for its values, as
``self_attn.k_scale`` / ``v_scale`` (or ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``); without
them the scales are 1.0, vLLM's default.

The cache holds ``k / k_scale`` and ``v / v_scale`` in e4m3. Attention is linear in both, so the scales fold
into it: scores ``scale * q.k = (scale * k_scale) * q.(k / k_scale)`` and output
``sum p v = v_scale * sum p (v / v_scale)``. The attention layer does that around any backend
(``Attention.attend``), which then needs no scale arguments: keys and values are divided before the write, the
softmax scale multiplied, and the output multiplied after."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from cb_serve.model_executor.layers.checkpoint import materialize

NAMES = (("k_scale", "v_scale"), ("k_proj.output_scale", "v_proj.output_scale"))  # after ``self_attn.``


@dataclass(frozen=True)
class KVCacheScales:
    k_scale: float
    v_scale: float

    def __post_init__(self) -> None:
        assert self.k_scale > 0 and self.v_scale > 0, f"KV-cache scales must be positive: {self}"

    @classmethod
    def read(cls, state: Mapping, prefix: str, source_layer: int | None = None) -> KVCacheScales | None:
        """The scales under ``prefix`` (``model.layers.{i}.self_attn.``), or under layer ``source_layer``'s
        prefix for a KV-shared layer (it reads that layer's cache); None where the checkpoint has none."""
        if source_layer is not None:
            prefix = re.sub(r"layers\.\d+\.", f"layers.{source_layer}.", prefix)
        for k_name, v_name in NAMES:
            if prefix + k_name in state and prefix + v_name in state:
                tensors = [materialize(state[prefix + n]).float() for n in (k_name, v_name)]
                if any(t.numel() != 1 for t in tensors):  # llm-compressor's per-head strategy, say
                    raise ValueError(f"{prefix}{k_name} / {v_name}: only per-tensor KV-cache scales are supported, "
                                     f"not shapes {[list(t.shape) for t in tensors]}")  # fmt: skip
                k, v = (float(t.reshape(())) for t in tensors)
                if not (k > 0 and v > 0):
                    raise ValueError(f"{prefix}{k_name} / {v_name}: KV-cache scales must be positive, got {k}, {v}")
                return cls(k, v) if (k, v) != (1.0, 1.0) else None
        return None

    def scaled_kv(self, k: torch.Tensor | None, v: torch.Tensor | None):
        """The keys and values as the cache holds them (before the write's cast)."""
        return (None, None) if k is None else (k / self.k_scale, v / self.v_scale)

    def softmax_scale(self, scale: float) -> float:
        return scale * self.k_scale

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o * self.v_scale
