"""What KV cache each attention layer keeps, and how layers of different kinds share one block pool
(vLLM's ``kv_cache_interface`` and hybrid KV-cache manager).

A layer keeps either every token's KV (full attention) or only the last ``sliding_window`` tokens', or
none of its own: it reads another layer's (Gemma 4's KV-shared layers, ``shared_from``).
Layers of one kind form *groups* of ``group_size`` layers each; a group has its own block table per
sequence, and all groups draw blocks from one pool. A block id means ``group_size`` pages, one in
each of ``group_size`` KV tensors: layer ``j`` of every group lives in tensor ``j``. So a block
costs the same in every group, the pool is shared, and a sliding group frees the blocks its window
no longer sees while full groups keep theirs. With one kind of layer there is one group of every
layer: a block holds one page of each layer, as before.

A recurrent layer (Gated DeltaNet, Mamba2) keeps no KV at all but a fixed-size state per sequence
(``StateSpec``, vLLM's ``MambaSpec``): a layout's ``state_layers`` are in no group, and each running
sequence holds one state slot (``engine/state_slots.py``) whatever its length.
"""

from __future__ import annotations

from dataclasses import dataclass

NULL_BLOCK = -1  # a sliding group's table entry for a block out of its window (freed, or never taken)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with the same cache kind whose block tables are one (``sliding_window`` None: full)."""

    sliding_window: int | None
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.layers and (self.sliding_window is None or self.sliding_window > 0), self

    def blocks_for(self, num_tokens: int, block_size: int, new_tokens: int = 1) -> int:
        """Blocks one sequence of ``num_tokens`` tokens holds in this group at most, while a step
        computes ``new_tokens`` of them: all, or (sliding) those the window before the step's first
        token and the step's tokens span (``window - 1 + new_tokens`` positions)."""
        blocks = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return blocks
        return min(blocks, (self.sliding_window + new_tokens - 2) // block_size + 2)


@dataclass(frozen=True)
class StateSpec:
    """One recurrent layer's state per sequence (this rank's heads): the causal convolution's last inputs
    ``conv_shape`` (``[channels, kernel]``) and the recurrence's matrix ``ssm_shape`` (Gated DeltaNet
    ``[value heads, key dim, value dim]``, Mamba2 ``[heads, head dim, state dim]``), in float32 as HF's
    PyTorch paths keep them."""

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    bytes_per_value: int = 4

    def __post_init__(self) -> None:
        assert all(d > 0 for d in self.conv_shape + self.ssm_shape) and self.bytes_per_value > 0, self

    @property
    def bytes_per_slot(self) -> int:
        conv = ssm = 1
        for d in self.conv_shape:
            conv *= d
        for d in self.ssm_shape:
            ssm *= d
        return (conv + ssm) * self.bytes_per_value


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's KV-cache groups (full-attention ones first) and each layer's place in them."""

    groups: tuple[KVCacheGroup, ...]
    num_layers: int
    shared_from: tuple[tuple[int, int], ...] = ()  # (layer, the earlier layer whose KV it reads)
    state_layers: tuple[int, ...] = ()  # recurrent layers: a state slot per sequence, no KV

    def __post_init__(self) -> None:
        shared = dict(self.shared_from)
        layers = sorted([layer for g in self.groups for layer in g.layers] + list(shared) + list(self.state_layers))
        assert layers == list(range(self.num_layers)), "every layer in exactly one group, shared, or recurrent"
        assert all(src < layer and src not in shared for layer, src in shared.items()), self.shared_from
        assert all(len(g.layers) <= self.group_size for g in self.groups)

    @classmethod
    def from_windows(
        cls,
        windows: list[int | None],
        hybrid: bool = True,
        shared_from: dict[int, int] | None = None,
        state_layers: tuple[int, ...] = (),
    ) -> KVCacheLayout:
        """Groups for layers with these sliding windows (None: full attention). Layers of one kind
        are cut into groups of the smallest kind's layer count (the last group of a kind may be
        short: its missing layers' pages go unused). ``hybrid=False``: one group of every layer,
        which keeps every token for every layer (a window then only masks), as vLLM's
        ``disable_hybrid_kv_cache_manager``. ``shared_from``: layers without a cache of their own,
        each reading an earlier (owning) layer's: it gets that layer's group and tensor. ``state_layers``:
        recurrent layers, in no group (their windows are not read)."""
        assert windows
        shared, states = dict(shared_from or {}), tuple(sorted(state_layers))
        owners = [layer for layer in range(len(windows)) if layer not in shared and layer not in states]
        pairs = tuple(sorted(shared.items()))
        if not hybrid:
            return cls((KVCacheGroup(None, tuple(owners)),), len(windows), pairs, states)
        kinds: dict[int | None, list[int]] = {}
        for layer in owners:
            kinds.setdefault(windows[layer], []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full attention first
        groups = tuple(
            KVCacheGroup(window, tuple(kinds[window][i : i + size]))
            for window in order
            for i in range(0, len(kinds[window]), size)
        )
        return cls(groups, len(windows), pairs, states)

    @property
    def group_size(self) -> int:
        """Layers per group: the number of KV tensors, and the pages one block id stands for."""
        return max(len(g.layers) for g in self.groups)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """Each layer's group."""
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        for layer, src in self.shared_from:
            out[layer] = out[src]
        return tuple(out)

    @property
    def layer_tensors(self) -> tuple[int, ...]:
        """Each layer's KV tensor: its place within its group."""
        out = [0] * self.num_layers
        for group in self.groups:
            for j, layer in enumerate(group.layers):
                out[layer] = j
        for layer, src in self.shared_from:
            out[layer] = out[src]
        return tuple(out)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].sliding_window is not None

    def blocks_per_sequence(self, num_tokens: int, block_size: int, new_tokens: int = 1) -> int:
        """Blocks of the pool one sequence of ``num_tokens`` tokens needs at most, over all groups,
        in a step computing ``new_tokens`` of them."""
        return sum(g.blocks_for(num_tokens, block_size, new_tokens) for g in self.groups)
