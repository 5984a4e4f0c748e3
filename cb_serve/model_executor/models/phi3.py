"""Phi-3 and Phi-4-mini: Llama's layer, with
- fused ``qkv_proj`` and ``gate_up_proj`` checkpoint weights (HF's own layout equals ours; the attention and
  MLP layers read their rows, so each rank still reads only its slices);
- partial rotary (``partial_rotary_factor``: Phi-4-mini turns the first 3/4 of each head): the
  RoPE tables are ``rotary_dim`` wide and ``Rope`` turns only those dims;
- LongRoPE (``rope_type`` ``longrope``): short factors for positions below
  ``original_max_position_embeddings``, long factors from there on (``layers/rope_tables.py``), what
  HF uses for each newest token; HF recomputes a longer sequence with the long factors throughout
  (``Phi3ForCausalLM.prepare_inputs_for_generation`` drops its cache), which a paged KV cache does not;
- a sliding window on every layer where the config sets ``sliding_window`` (HF 5.x then masks
  every layer with it, as Mistral).
Follows ``transformers.models.phi3.modeling_phi3`` op for op."""

from __future__ import annotations

import logging

import torch

from cb_serve.model_executor.layers.rotary import longrope_switch
from cb_serve.model_executor.models.base import CausalLM
from cb_serve.model_executor.models.llama import llama_attention
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan, refuse

logger = logging.getLogger(__name__)


class Phi3ForCausalLM(CausalLM):
    @classmethod
    def plan(cls, config) -> ModelPlan:
        refuse("Phi-3", config, ("attention_bias", "mlp_bias"))  # Phi-3 has none: a config asking for them is not Phi-3
        return ModelPlan(tuple(LayerPlan(spec) for spec in llama_attention(config)), rope_partial_default=True)

    def __init__(self, config, backend, rope_cos: torch.Tensor, *args, **kwargs) -> None:
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
