"""RoPE's cos/sin tables, computed here from ``config.rope_parameters`` for every ``rope_type`` the served
families use: ``default``, ``linear``, ``dynamic`` (NTK), ``yarn``, ``longrope``, ``llama3`` and
``proportional`` (Gemma 4's global layers), and M-RoPE (Qwen3-VL, Qwen3.5) at text positions, where its
three sections share one position and it is the default RoPE. Nothing is read from transformers' modules
(their internals differ between versions); their rotary modules are the reference in
``tests/kernels/test_rope_tables.py``, in float32 op for op. Each formula is its paper's:

- ``linear``: positions interpolated by ``factor``;
- ``dynamic``: the NTK-aware base grown to the served length (``max_positions``);
- ``yarn``: a ramp between interpolated and extrapolated frequencies, cos/sin scaled by its ``mscale``;
- ``longrope``: per-frequency factors, the short ones below ``original_max_position_embeddings``;
- ``llama3``: low frequencies interpolated by ``factor``, a smooth ramp to the high ones;
- ``proportional``: the first ``partial_rotary_factor`` of the pairs turn (at the head's own width), the rest
  stay still."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cb_serve.config.layer_configs import layer_configs, layer_head_dim


@dataclass(frozen=True)
class RopeSpec:
    """One table's parameters: a ``rope_parameters`` dict, the head size it turns, the model's
    ``max_position_embeddings``, and whether the default type reads ``partial_rotary_factor``."""

    params: dict
    head_dim: int
    max_position_embeddings: int
    partial_default: bool = False

    def __post_init__(self) -> None:
        assert self.head_dim > 0 and self.head_dim % 2 == 0, self.head_dim
        assert "rope_theta" in self.params, self.params

    @property
    def base(self) -> float:
        return self.params["rope_theta"]

    @property
    def dim(self) -> int:
        """The rotary dims: the head, or its first ``partial_rotary_factor``."""
        return int(self.head_dim * self.params.get("partial_rotary_factor", 1.0))

    @property
    def original_max(self) -> int:
        return self.params.get("original_max_position_embeddings") or self.max_position_embeddings


InvFreq = tuple[torch.Tensor, float]  # a frequency per rotary pair, and the factor on cos and sin


def powers(base: float | torch.Tensor, dim: int, width: int | None = None) -> torch.Tensor:
    """``base ** (2i / dim)`` for the ``width`` (default ``dim``) dims' pairs."""
    return base ** (torch.arange(0, dim if width is None else width, 2, dtype=torch.int64).float() / dim)


def default(spec: RopeSpec, max_positions: int) -> InvFreq:
    dim = spec.dim if spec.partial_default else spec.head_dim
    return 1.0 / powers(spec.base, dim), 1.0


def linear(spec: RopeSpec, max_positions: int) -> InvFreq:
    return 1.0 / powers(spec.base, spec.dim) / spec.params["factor"], 1.0


def dynamic(spec: RopeSpec, max_positions: int) -> InvFreq:
    """The base grown for the longest served sequence (as a float32 tensor, as transformers grows it per call)."""
    factor, trained, dim = spec.params["factor"], spec.max_position_embeddings, spec.dim
    seq_len = torch.tensor(max_positions) if max_positions > trained else trained  # (a Python float within it)
    base = spec.base * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / powers(base, dim), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(spec: RopeSpec, max_positions: int) -> InvFreq:
    p, dim, base = spec.params, spec.dim, spec.base
    factor = p.get("factor") or spec.max_position_embeddings / spec.original_max
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        both = mscale and mscale_all_dim
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if both else yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times over the trained length
        return dim * math.log(spec.original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high += 0.001 if low == high else 0
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = powers(base, dim)
    extrapolated = 1 - ramp
    return 1.0 / (factor * pos) * (1 - extrapolated) + 1.0 / pos * extrapolated, float(attention)


def longrope(spec: RopeSpec, max_positions: int, long: bool = False) -> InvFreq:
    """The short factors (``long``: the long ones); cos/sin scaled as the paper's default does."""
    p, original = spec.params, spec.original_max
    factor = p.get("factor") or spec.max_position_embeddings / original
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * powers(spec.base, spec.dim)), attention


def llama3(spec: RopeSpec, max_positions: int) -> InvFreq:
    p = spec.params
    factor, low_ff, high_ff, trained = p["factor"], p["low_freq_factor"], p["high_freq_factor"], spec.original_max
    inv = 1.0 / powers(spec.base, spec.dim)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > trained / low_ff, inv / factor, inv)
    smooth = (trained / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < trained / high_ff) * ~(wavelen > trained / low_ff)
    return torch.where(medium, smoothed, scaled), 1.0


def proportional(spec: RopeSpec, max_positions: int) -> InvFreq:
    turning = int(spec.params.get("partial_rotary_factor", 1.0) * spec.head_dim // 2)
    inv = 1.0 / powers(spec.base, spec.head_dim, 2 * turning)
    still = torch.zeros(spec.head_dim // 2 - turning)
    return torch.cat([inv, still]) / spec.params.get("factor", 1.0), 1.0


INV_FREQ: dict[str, Callable[[RopeSpec, int], InvFreq]] = {
    "default": default,
    "linear": linear,
    "dynamic": dynamic,
    "yarn": yarn,
    "longrope": longrope,
    "llama3": llama3,
    "proportional": proportional,
    "mrope": default,  # an older config's M-RoPE: at text positions, the default
}


def cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half's tables ``[positions, 2 * pairs]``: each pair's angle on both of its dims."""
    angles = positions[:, None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


def table(spec: RopeSpec, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One table; LongRoPE takes the long factors from ``original_max_position_embeddings`` on."""
    rope_type = spec.params.get("rope_type", "default")
    if rope_type not in INV_FREQ:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(INV_FREQ)}.")
    positions = torch.arange(max_positions)
    cos, sin = cos_sin(*INV_FREQ[rope_type](spec, max_positions), positions)
    if rope_type == "longrope" and spec.original_max < max_positions:
        far = positions[spec.original_max :]
        cos[spec.original_max :], sin[spec.original_max :] = cos_sin(*longrope(spec, max_positions, long=True), far)
    return cos, sin


def rope_specs(config, layer_types: tuple[str, ...] | None, partial_default: bool) -> list[RopeSpec]:
    """One spec per table: per layer type (its own parameters and head size) or one for the model."""
    params, configs = config.rope_parameters, layer_configs(config)
    specs = []
    for kind in layer_types or (None,):
        own = params if kind is None else params[kind]
        layer = configs[config.layer_types.index(kind)] if kind is not None else config
        specs.append(RopeSpec(dict(own), layer_head_dim(layer), config.max_position_embeddings, partial_default))
    return specs


def rope_tables(config, max_positions: int, layer_types: tuple[str, ...] | None = None, partial_default: bool = False,
                nope: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos/sin ``[tables, max_positions, rotary dims]`` for positions ``0..max_positions-1``: one table per
    layer type (``layer_types``) or one, narrower ones zero-padded on the right to the widest (Gemma 4's global
    heads are wider); ``nope`` (no position embedding: Granite 4 hybrids): empty tables, RoPE a no-op."""
    if nope:
        return torch.zeros(1, max_positions, 0), torch.zeros(1, max_positions, 0)
    tables = [table(spec, max_positions) for spec in rope_specs(config, layer_types, partial_default)]
    width = max(cos.shape[-1] for cos, _ in tables)

    def stack(ys: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(y, (0, width - y.shape[-1])) for y in ys])

    return stack([cos for cos, _ in tables]), stack([sin for _, sin in tables])
