"""Activation quantization (W8A8): a checkpoint whose scheme quantizes each linear layer's input as well as its
weight (``quant_method: fp8`` with an ``activation_scheme``; compressed-tensors ``input_activations``). On a
device with FP8 or INT8 GEMMs the input is quantized and the GEMM multiplies the codes; here, where no such
kernel exists yet, the input is quantized and dequantized in float32 before the float GEMM (``ActivationQuant``,
"QDQ"), which computes the same products as the low-precision GEMM up to its float32 summation order.

Scales, as vLLM computes them:

- **dynamic**, one scale per token (``group_size`` None) or per group of ``group_size`` inputs of a token
  (DeepSeek V3's and Qwen3's 1 x 128 for 128 x 128 weight blocks): ``max(|x|) / 448`` (e4m3) or ``/ 127`` (int8),
  floored at vLLM's minimum so an all-zero token divides by no zero. A dynamic *per-tensor* scheme is computed
  per token instead: a scale over the whole batch would make one request's numbers depend on the others
  sharing its step;
- **static**: one calibrated scale per layer from the checkpoint (``X.input_scale``); the parts of a fused
  projection (q, k, v) share the largest of theirs, as vLLM's fused layers do.

The codes are rounded as the formats round: e4m3 to nearest even, saturated at ±448; int8 to nearest even,
clamped to ±127 (symmetric only)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch

KINDS = {"fp8": 448.0, "int8": 127.0}  # each code's largest magnitude
STATIC_SCALE_NAMES = ("input_scale", "activation_scale")  # after ``X.``: llm-compressor's / vLLM's, transformers'


@dataclass(frozen=True)
class ActivationQuant:
    """One linear layer's input quantization: ``kind`` fp8 (e4m3) or int8; dynamic scales per token or per
    ``group_size`` inputs, or one ``static_scale``."""

    kind: str
    group_size: int | None = None
    static_scale: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"activation quantization {self.kind!r}: one of {list(KINDS)}")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"activation quantization group size must be positive, not {self.group_size}")
        if self.static_scale is not None and not (0 < self.static_scale < float("inf")):
            raise ValueError(f"a static activation scale must be positive and finite, not {self.static_scale}")

    @property
    def dynamic(self) -> bool:
        return self.static_scale is None

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``[rows, groups]`` (``groups`` 1 per token or static): the scale each input divides by."""
        if not self.dynamic:
            return x.new_full((1, 1), self.static_scale, dtype=torch.float32)
        largest = KINDS[self.kind]
        group = self.group_size or x.shape[-1]
        groups = -(-x.shape[-1] // group)
        padded = torch.nn.functional.pad(x.float().abs(), (0, groups * group - x.shape[-1]))  # a short last group
        amax = padded.view(x.shape[0], groups, group).amax(dim=-1)
        return (amax / largest).clamp(min=1.0 / (largest * 512))  # vLLM's floor (MIN_SCALING_FACTOR)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, inputs]`` as the quantized codes times their scales, in ``x``'s dtype."""
        if x.dim() != 2 or x.shape[0] == 0:
            return x if x.numel() == 0 else self(x.reshape(-1, x.shape[-1])).view_as(x)
        scale = self.scales(x)
        group = self.group_size if self.dynamic and self.group_size else x.shape[-1]
        per_input = scale.repeat_interleave(group, dim=1)[:, : x.shape[-1]] if scale.shape[1] > 1 else scale
        scaled, largest = x.float() / per_input, KINDS[self.kind]
        if self.kind == "fp8":
            codes = scaled.clamp(-largest, largest).to(torch.float8_e4m3fn).float()
        else:
            codes = scaled.round().clamp(-largest, largest)  # round: half to even, as vLLM's nearbyint
        return (codes * per_input).to(x.dtype)


def merge(quants: Iterable[ActivationQuant | None], name: str = "a projection") -> ActivationQuant | None:
    """The quantization of a projection fused from parts (q, k, v; gate, up): theirs, which must agree; static
    scales become their largest. A part without one (a view of a part loses it: a gated q's rows) takes the
    others'."""
    quants = [q for q in quants if q is not None]
    if not quants:
        return None
    if len({(q.kind, q.group_size, q.dynamic) for q in quants}) != 1:
        raise ValueError(f"{name}: its fused parts quantize their inputs differently: {quants}")
    if quants[0].dynamic:
        return quants[0]
    return replace(quants[0], static_scale=max(q.static_scale for q in quants))


def static_scale(state: Mapping, weight_name: str) -> float:
    """The calibrated input scale beside ``weight_name`` (``X.weight`` -> ``X.input_scale``): one positive value."""
    base = weight_name.removesuffix("weight")
    name = next((base + n for n in STATIC_SCALE_NAMES if base + n in state), None)
    if name is None:
        raise ValueError(f"{weight_name}: the checkpoint quantizes activations statically, and has no "
                         f"{base}input_scale for it")  # fmt: skip
    value = state[name]
    value = (value if isinstance(value, torch.Tensor) else value.raw()).float()  # a LazyTensor as stored, not cast
    if value.numel() != 1:
        raise ValueError(f"{name}: only one input scale per layer is supported, not shape {list(value.shape)}")
    return float(value.reshape(()))


@dataclass(frozen=True)
class ActivationScheme:
    """A checkpoint's activation quantization, before each layer's static scale is read."""

    kind: str
    dynamic: bool
    group_size: int | None = None

    def __post_init__(self) -> None:
        ActivationQuant(self.kind, self.group_size)  # the same checks
        assert self.dynamic or self.group_size is None, "a static scheme has one scale per tensor"

    def for_weight(self, state: Mapping, weight_name: str) -> ActivationQuant:
        if self.dynamic:
            return ActivationQuant(self.kind, self.group_size)
        return ActivationQuant(self.kind, None, static_scale(state, weight_name))

    def describe(self) -> str:
        group = f" groups of {self.group_size}" if self.group_size else ""
        return f"{self.kind.upper()} {'dynamic per-token' if self.dynamic else 'static per-tensor'}{group}"
