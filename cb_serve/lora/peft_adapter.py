"""Reads a PEFT LoRA adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``
or ``.bin``) into the layout cb-serve's fused projections use, checking it against the model.

Each fused projection (q/k/v, gate/up) gets one ``A`` of the targeted sub-projections' rows
stacked, ``[R, in]``, and one block-structured ``B``, ``[R, out]``, with each sub-projection's
scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) folded in: ``x @ A.T @ B`` is PEFT's
``lora_B(lora_A(x)) * scaling`` for every targeted sub-projection at once.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# cb-serve's fused projections and the HF projections each is made of, in column order. A recurrent layer's
# (``mixer``: Qwen3.5's Gated DeltaNet, whose HF name is ``linear_attn``; Granite 4's Mamba2, ``mamba``) input
# projection is one, in Qwen3.5's order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
    "mixer.in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "mixer.out_proj": ("out_proj",),
}
# Which fused projection a checkpoint's projection is in: at its part's columns (an index), or all of them
# (None); unless the layer spreads its rows over the columns (``ProjectionShape.grouped``, by its name).
FUSED_OF: dict[str, tuple[str, int | str | None]] = {
    sub: (fused, i) for fused, subs in FUSED_PROJECTIONS.items() for i, sub in enumerate(subs)
}
# Checkpoints whose own projections are fused (Phi-3; Mamba2's in_proj): an adapter on one spans all its
# columns; Qwen3-Next's are grouped per key head ([q | k | v | z] of each, then [b | a] of each).
FUSED_OF.update({"qkv_proj": ("self_attn.qkv_proj", None), "gate_up_proj": ("mlp.gate_up_proj", None)})
FUSED_OF.update({"in_proj": ("mixer.in_proj", None)})
FUSED_OF.update({name: ("mixer.in_proj", name) for name in ("in_proj_qkvz", "in_proj_ba")})  # always spread
SUPPORTED_TARGETS = tuple(FUSED_OF)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp|linear_attn|mamba)\.(\w+)\.lora_([AB])"
    r"(?:\.[\w-]+)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served (missing files, unsupported options or targets, too high a
    rank, or shapes of another base model)."""


@dataclass(frozen=True)
class ProjectionShape:
    """One fused projection of the model: its input size and its sub-projections' output sizes; ``grouped``:
    a checkpoint projection whose rows land spread over those columns, each row's column (Qwen3-Next's)."""

    in_features: int
    sub_out_features: tuple[int, ...]
    grouped: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False, hash=False)


@dataclass
class LoRAWeights:
    """One adapter in cb-serve's layout: ``modules[name] = (A [R, in], B [R, out])`` per targeted
    fused projection (``name`` as ``layers.{i}.self_attn.qkv_proj``), scales folded into ``B``."""

    name: str
    rank: int  # the largest sub-projection rank
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def read_adapter_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAAdapterError(f"No adapter_config.json in {str(path)!r}: not a PEFT adapter directory.")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"Cannot read {config_file}: {e}") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{config_file} is not a JSON object.")
    if config.get("target_parameters"):  # PEFT's LoRA on parameters: a mixture of experts' fused expert weights
        raise LoRAAdapterError(
            f"Adapter at {str(path)!r} has target_parameters={config['target_parameters']!r}: the experts of a "
            f"mixture-of-experts layer, which cb-serve does not serve adapters on; adapters on such models may "
            f"target the attention projections and dense MLPs."
        )
    refused = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "lora_bias": bool(config.get("lora_bias")),
    }
    bad = [name for name, is_bad in refused.items() if is_bad]
    if bad:
        shown = ", ".join(f"{k}={config.get(k)!r}" for k in bad)
        raise LoRAAdapterError(f"Unsupported adapter option(s) in {config_file}: {shown} (plain LoRA only).")
    return config


def read_adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_file))
        if bin_file.is_file():
            tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise ValueError("not a mapping of names to tensors")
            return tensors
    except Exception as e:  # noqa: BLE001 - a corrupt file is the adapter's problem, reported as such
        raise LoRAAdapterError(f"Cannot read the adapter weights in {str(path)!r}: {e}") from e
    raise LoRAAdapterError(f"No adapter_model.safetensors (or .bin) in {str(path)!r}.")


def load_peft_adapter(
    name: str, path: str | Path, shapes: dict[str, ProjectionShape], max_rank: int, dtype: torch.dtype
) -> LoRAWeights:
    """The adapter at ``path`` for a model whose fused projections have ``shapes`` (keyed as
    ``layers.{i}.self_attn.qkv_proj``). Raises ``LoRAAdapterError`` naming what does not fit."""
    path = Path(path)
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a directory.")
    config = read_adapter_config(path)
    alpha, use_rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))  # PEFT's default alpha
    base = config.get("base_model_name_or_path")
    pairs = _lora_pairs(name, path)
    if not pairs:
        raise LoRAAdapterError(f"Adapter {name!r} at {str(path)!r} has no LoRA weights.")
    parts: dict[str, list[tuple[str, int | str | None, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, block, sub), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "A" if "A" not in ab else "B"
            raise LoRAAdapterError(f"Adapter {name!r}: layers.{layer}.{block}.{sub} lacks lora_{missing}.")
        fused, index = FUSED_OF[sub]
        module = f"layers.{layer}.{fused}"
        a, b = ab["A"], ab["B"]
        r = a.shape[0] if a.dim() == 2 else -1
        expected = _part_shape(shapes.get(module), index, sub)
        if expected is None or r < 1 or b.shape != (expected[1], r) or a.shape[1] != expected[0]:
            got = f"lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}"
            want = "no such layer or projection" if expected is None else f"{expected[0]} -> {expected[1]}"
            raise LoRAAdapterError(
                f"Adapter {name!r} does not fit this model at layers.{layer}.{block}.{sub} ({want}; the adapter "
                f"has {got}): it was trained for another base model{f' ({base})' if base else ''}."
            )
        if r > max_rank:
            raise LoRAAdapterError(f"Adapter {name!r} has rank {r} at {sub}, above max_lora_rank={max_rank}.")
        rank = max(rank, r)
        scale = alpha / (math.sqrt(r) if use_rslora else r)
        parts.setdefault(module, []).append((sub, index, a, b * scale))
    modules = {module: _fused_pair(name, module, subs, shapes[module], dtype) for module, subs in parts.items()}
    return LoRAWeights(name, rank, modules)


def _part_shape(shape: ProjectionShape | None, index: int | str | None, sub: str) -> tuple[int, int] | None:
    """``(in, out)`` of checkpoint projection ``sub``, part ``index`` of a fused projection; None where the layer
    has no such part (Gemma 4's KV-shared layers, V = K; a recurrent layer of the other kind)."""
    if shape is None:
        return None
    if sub in shape.grouped:
        return shape.in_features, len(shape.grouped[sub])
    if index is None:
        return shape.in_features, sum(shape.sub_out_features)
    if isinstance(index, str):  # spread over the columns by a layer that has no such grouping
        return None
    return (shape.in_features, shape.sub_out_features[index]) if index < len(shape.sub_out_features) else None


def _lora_pairs(name: str, path: Path) -> dict[tuple[int, str, str], dict[str, torch.Tensor]]:
    """The adapter's ``lora_A`` / ``lora_B`` tensors by (layer, block, projection)."""
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in read_adapter_tensors(path).items():
        m = _KEY.match(key)
        if m is None and (".experts." in key or ".block_sparse_moe." in key):
            raise LoRAAdapterError(
                f"Adapter {name!r} targets the experts of a mixture-of-experts layer ({key!r}), which cb-serve does "
                f"not serve adapters on; adapters on such models may target the attention projections and dense MLPs."
            )
        if m is None or m.group(3) not in FUSED_OF:
            raise LoRAAdapterError(
                f"Adapter {name!r} targets {key!r}: cb-serve applies LoRA to the decoder layers' "
                f"{', '.join(SUPPORTED_TARGETS)} only."
            )
        layer, block, sub, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        pairs.setdefault((layer, block, sub), {})[ab] = tensor
    return pairs


def _fused_pair(
    name: str,
    module: str,
    subs: list[tuple[str, int | str | None, torch.Tensor, torch.Tensor]],
    shape: ProjectionShape,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused projection's ``(A, B)``: its parts' A rows stacked, B block-structured (a part's
    rank rows feed its own output columns; ``index`` None: the whole fused projection)."""
    if len(subs) > 1 and any(index is None for _, index, _, _ in subs):
        raise LoRAAdapterError(f"Adapter {name!r} targets {module} both fused and by its parts.")
    offsets = [0, *itertools.accumulate(shape.sub_out_features)]
    a_cat = torch.cat([a for _, _, a, _ in subs]).to(dtype).contiguous()
    b_cat = torch.zeros(a_cat.shape[0], offsets[-1], dtype=dtype)
    row = 0
    for sub, index, a, b in subs:
        rows = slice(row, row + a.shape[0])
        if sub in shape.grouped:  # each of its rows at its own column
            b_cat[rows].index_copy_(1, torch.tensor(shape.grouped[sub]), b.t().to(dtype))
        else:
            b_cat[rows, slice(None) if index is None else slice(offsets[index], offsets[index + 1])] = b.t()
        row += a.shape[0]
    return a_cat, b_cat
