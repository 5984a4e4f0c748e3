"""Per-layer views of an HF config. Most models' layers share one shape; a heterogeneous config
(transformers' ``per_layer_config``: Gemma 4's global layers have their own head size and KV heads)
raises on a global read of such an attribute, so code sizing heads or the KV cache asks per layer."""

from __future__ import annotations


def layer_configs(config) -> list:
    """Each layer's config: its own view where the config is heterogeneous, else ``config`` itself."""
    if getattr(config, "is_heterogeneous", False):
        return [config.per_layer_config[i] for i in range(config.num_hidden_layers)]
    return [config] * config.num_hidden_layers


def layer_head_dim(config) -> int:
    """The head size of a (homogeneous or per-layer) config."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_widths(config) -> list[int]:
    """Each layer's K (and V) values per token: ``num_key_value_heads * head_dim``."""
    return [c.num_key_value_heads * layer_head_dim(c) for c in layer_configs(config)]
