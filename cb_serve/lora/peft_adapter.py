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
from dataclasses import dataclass
from pathlib import Path

import torch

# cb-serve's fused projections and the HF projections each is made of, in column order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
FUSED_OF: dict[str, tuple[str, int | None]] = {
    sub: (fused, i) for fused, subs in FUSED_PROJECTIONS.items() for i, sub in enumerate(subs)
}
# Checkpoints whose own projections are fused (Phi-3): an adapter on one spans all its columns.
FUSED_OF.update({"qkv_proj": ("self_attn.qkv_proj", None), "gate_up_proj": ("mlp.gate_up_proj", None)})
SUPPORTED_TARGETS = tuple(FUSED_OF)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served (missing files, unsupported options or targets, too high a
    rank, or shapes of another base model)."""


@dataclass(frozen=True)
class ProjectionShape:
    """One fused projection of the model: its input size and its sub-projections' output sizes."""

    in_features: int
    sub_out_features: tuple[int, ...]


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
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, block, sub), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "A" if "A" not in ab else "B"
            raise LoRAAdapterError(f"Adapter {name!r}: layers.{layer}.{block}.{sub} lacks lora_{missing}.")
        fused, index = FUSED_OF[sub]
        module = f"layers.{layer}.{fused}"
        a, b = ab["A"], ab["B"]
        r = a.shape[0] if a.dim() == 2 else -1
        shape = shapes.get(module)
        if shape is not None and index is not None and index >= len(shape.sub_out_features):
            shape = None  # a projection this layer has not (Gemma 4: KV-shared layers, V = K)
        out = None if shape is None else sum(shape.sub_out_features) if index is None else shape.sub_out_features[index]
        expected = None if shape is None else (shape.in_features, out)
        if shape is None or r < 1 or b.shape != (expected[1], r) or a.shape[1] != expected[0]:
            got = f"lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}"
            want = "no such layer or projection" if shape is None else f"{expected[0]} -> {expected[1]}"
            raise LoRAAdapterError(
                f"Adapter {name!r} does not fit this model at layers.{layer}.{block}.{sub} ({want}; the adapter "
                f"has {got}): it was trained for another base model{f' ({base})' if base else ''}."
            )
        if r > max_rank:
            raise LoRAAdapterError(f"Adapter {name!r} has rank {r} at {sub}, above max_lora_rank={max_rank}.")
        rank = max(rank, r)
        scale = alpha / (math.sqrt(r) if use_rslora else r)
        parts.setdefault(module, []).append((index, a, b * scale))
    modules = {module: _fused_pair(name, module, subs, shapes[module], dtype) for module, subs in parts.items()}
    return LoRAWeights(name, rank, modules)


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
    subs: list[tuple[int | None, torch.Tensor, torch.Tensor]],
    shape: ProjectionShape,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused projection's ``(A, B)``: its parts' A rows stacked, B block-structured (a part's
    rank rows feed its own output columns; ``index`` None: the whole fused projection)."""
    if len(subs) > 1 and any(index is None for index, _, _ in subs):
        raise LoRAAdapterError(f"Adapter {name!r} targets {module} both fused and by its parts.")
    offsets = [0, *itertools.accumulate(shape.sub_out_features)]
    a_cat = torch.cat([a for _, a, _ in subs]).to(dtype).contiguous()
    b_cat = torch.zeros(a_cat.shape[0], offsets[-1], dtype=dtype)
    row = 0
    for index, a, b in subs:
        columns = slice(None) if index is None else slice(offsets[index], offsets[index + 1])
        b_cat[row : row + a.shape[0], columns] = b.t()
        row += a.shape[0]
    return a_cat, b_cat
