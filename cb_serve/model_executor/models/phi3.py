"""Phi-3 and Phi-4-mini: Llama's skeleton with
- fused ``qkv_proj`` and ``gate_up_proj`` checkpoint weights (HF's own layout equals ours; they are
  seen as Llama's q/k/v and gate/up names so each rank still reads only its slices);
- partial rotary (``partial_rotary_factor``: Phi-4-mini turns the first 3/4 of each head): the
  RoPE tables are ``rotary_dim`` wide and ``Rope`` turns only those dims;
- LongRoPE (``rope_type`` ``longrope``): short factors for positions below
  ``original_max_position_embeddings``, long factors from there on (``loader.rope_tables``), what
  HF uses for each newest token; HF recomputes a longer sequence with the long factors throughout
  (``Phi3ForCausalLM.prepare_inputs_for_generation`` drops its cache), which a paged KV cache does not;
- a sliding window on every layer where the config sets ``sliding_window`` (HF 5.x then masks
  every layer with it, as Mistral).
Follows ``transformers.models.phi3.modeling_phi3`` op for op."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from cb_serve.model_executor.layers.attention import head_dim
from cb_serve.model_executor.layers.checkpoint import LazyTensor
from cb_serve.model_executor.layers.rotary import longrope_switch
from cb_serve.model_executor.models.llama import LlamaForCausalLM
from cb_serve.model_executor.models.state_views import Rows, StateView

logger = logging.getLogger(__name__)


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, backend, rope_cos: torch.Tensor, *args, **kwargs) -> None:
        for feature in ("attention_bias", "mlp_bias"):  # Phi-3 has none; a config asking for them is not Phi-3
            if getattr(config, feature, False):
                raise ValueError(f"Phi-3 with {feature}={getattr(config, feature)!r} is not supported.")
        super().__init__(config, backend, rope_cos, *args, **kwargs)
        switch = longrope_switch(config)
        if switch is not None and rope_cos.shape[1] > switch:
            logger.warning(
                "LongRoPE: positions from %d on take the long factors, earlier ones the short. HF transformers "
                "instead recomputes a sequence longer than %d with the long factors throughout, so outputs "
                "of such sequences may differ from HF's.",
                switch,
                switch,
            )

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor | LazyTensor]) -> None:
        """Llama's loading, with each layer's fused ``qkv_proj`` and ``gate_up_proj`` seen as the
        separate projections (rows ``[q | k | v]`` and ``[gate | up]``, HF's order)."""
        config = self.config
        q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
        inter = config.intermediate_size
        extra = {}
        for i in range(len(self.layers)):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv, gate_up = state[attn + "qkv_proj.weight"], state[mlp + "gate_up_proj.weight"]
            for name, start, stop in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
                extra[f"{attn}{name}_proj.weight"] = Rows(qkv, start, stop)
            extra[mlp + "gate_proj.weight"] = Rows(gate_up, 0, inter)
            extra[mlp + "up_proj.weight"] = Rows(gate_up, inter, 2 * inter)
        super().load_hf_state_dict(StateView(state, extra))
