"""What a model family declares: its stack as a plan over the shared layers (``layers/``).

Per layer (``LayerPlan``): a **mixer** (attention with its ``AttentionSpec``, a Gated DeltaNet, a Mamba2
mixer), a **feed-forward** (a dense gated MLP, experts, experts beside a shared MLP), its **norms** (which
class, and where: before each sublayer, around each, or after each) and where its weights are in a
checkpoint. Its **KV kind** follows from the mixer: every token's KV, a sliding window's, another layer's
(read, never written), or a recurrent state per sequence. Per model (``ModelPlan``): the final norm, the
embedding's and the logits' scaling, and the RoPE tables.

The engine's view of the model derives from the plan alone: the KV-cache groups (``kv_layout``), the state
slots (``state_layers``), and through the modules it builds, the tensor-parallel slices and LoRA targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cb_serve.kv_cache_interface import KVCacheLayout
from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.layers.gated_deltanet import DeltaNetSpec
from cb_serve.model_executor.layers.mamba2 import Mamba2Spec
from cb_serve.model_executor.layers.moe import MoESpec
from cb_serve.model_executor.layers.norm import RMSNorm

Mixer = AttentionSpec | DeltaNetSpec | Mamba2Spec
PLACEMENTS = ("pre", "sandwich", "post")


@dataclass(frozen=True)
class DenseMLP:
    """The gated MLP, ``intermediate_size`` columns (None: the config's), split over the ranks."""

    intermediate_size: int | None = None


@dataclass(frozen=True)
class Experts:
    """A mixture of experts (``moe``); with ``shared_expert_size``, plus a shared expert every token goes
    through, gated per token by ``sigmoid(shared_expert_gate(x))``."""

    moe: MoESpec
    shared_expert_size: int | None = None


@dataclass(frozen=True)
class SharedMLPAndExperts:
    """A shared MLP of ``shared_size`` columns every token goes through, plus experts (``moe``; None: none),
    summed ungated (checkpoint names ``shared_mlp`` and ``block_sparse_moe``)."""

    shared_size: int
    moe: MoESpec | None = None


FeedForward = DenseMLP | Experts | SharedMLPAndExperts


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer. ``placement``: ``pre`` (a norm before each sublayer, the residual added inside the
    next norm), ``sandwich`` (a norm before and after each sublayer, before its residual add) or ``post``
    (a norm after each sublayer only). ``residual_multiplier``: each sublayer's output scaled before its
    residual add. ``mixer_prefix``: the mixer's name in a checkpoint's layer."""

    mixer: Mixer
    ffn: FeedForward = DenseMLP()
    norm: type[RMSNorm] = RMSNorm
    placement: str = "pre"
    residual_multiplier: float = 1.0
    mixer_prefix: str = "self_attn."

    def __post_init__(self) -> None:
        assert self.placement in PLACEMENTS, self.placement
        assert self.residual_multiplier > 0 and self.mixer_prefix.endswith("."), self

    @property
    def recurrent(self) -> bool:
        """A state per sequence instead of KV (``kv_cache_interface.StateSpec``)."""
        return not isinstance(self.mixer, AttentionSpec)


@dataclass(frozen=True)
class ModelPlan:
    """The stack, and around it: ``final_norm``; the embedding times ``embed_scale`` (rounded to the model's
    dtype first where ``embed_scale_in_dtype``, as a scaled embedding module keeps it); the logits divided
    by ``logits_divisor`` and soft-capped (``cap * tanh(logits / cap)``) by ``logits_softcap``; one RoPE
    table per entry of ``rope_layer_types`` (the layer type whose ``rope_parameters`` it follows; None: one
    table); ``rope_partial_default``: the default RoPE turns only ``partial_rotary_factor`` of each head (the
    family's HF default reads it; the scaled types always do); ``rope`` False: no position embedding (NoPE)."""

    layers: tuple[LayerPlan, ...]
    final_norm: type[RMSNorm] = RMSNorm
    embed_scale: float | None = None
    embed_scale_in_dtype: bool = False
    logits_divisor: float | None = None
    logits_softcap: float | None = None
    rope_layer_types: tuple[str, ...] | None = None
    rope_partial_default: bool = False
    rope: bool = True

    def __post_init__(self) -> None:
        assert self.layers, "a model has layers"
        assert self.logits_softcap is None or self.logits_softcap > 0, self.logits_softcap
        assert self.logits_divisor is None or self.logits_divisor != 0, self.logits_divisor
        tables = len(self.rope_layer_types or (None,))
        for i, layer in enumerate(self.layers):
            spec = layer.mixer
            if isinstance(spec, AttentionSpec):
                assert spec.rope_table is None or 0 <= spec.rope_table < tables, (i, spec.rope_table)
                assert spec.shares_kv_of is None or self.owns_kv(spec.shares_kv_of), (i, spec.shares_kv_of)

    def owns_kv(self, index: int) -> bool:
        """Layer ``index`` writes a KV cache of its own (an attention layer reading no other's)."""
        spec = self.layers[index].mixer
        return isinstance(spec, AttentionSpec) and spec.shares_kv_of is None

    @property
    def plain_logits(self) -> bool:
        """The logits are the LM head's output as it is (no scaling, no cap)."""
        return self.logits_divisor is None and self.logits_softcap is None

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.recurrent)

    @property
    def attention_specs(self) -> list[AttentionSpec | None]:
        """Each layer's attention (None: a recurrent layer)."""
        return [None if layer.recurrent else layer.mixer for layer in self.layers]

    def kv_layout(self, hybrid: bool = True) -> KVCacheLayout:
        """The KV-cache groups of the attention layers (``hybrid``: sliding windows in groups of their own)."""
        windows = [s.sliding_window if s is not None else None for s in self.attention_specs]
        states = self.state_layers
        return KVCacheLayout.from_windows(windows, hybrid=hybrid, shared_from=self.kv_shared, state_layers=states)

    @property
    def kv_shared(self) -> dict[int, int]:
        """Layers keeping no KV cache of their own: layer -> the earlier layer whose KV it reads."""
        return {i: s.shares_kv_of for i, s in enumerate(self.attention_specs) if s is not None and s.kv_shared}


def refuse(family: str, config, features: Sequence[str]) -> None:
    """Refused, never ignored: a config that turns on a feature the family's HF model does not apply."""
    for feature in features:
        if getattr(config, feature, None):
            raise ValueError(f"{family} with {feature}={getattr(config, feature)!r} is not supported.")
