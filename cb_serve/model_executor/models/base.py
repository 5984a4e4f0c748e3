"""The neutral decoder model every family is: ``CausalLM`` builds the stack a family's ``plan(config)``
declares (``plan.py``) over the shared layers, runs it on a ragged, paged batch, and loads an HF checkpoint
into it.

The math follows HF transformers' modeling code op for op (norms in their own dtypes and orders, rotate-half
RoPE, residual order), so float32 greedy outputs match ``model.generate`` token for token; the layout differs
where it is faster: fused QKV and gate/up projections, flattened tokens, and (with the ``cpu`` attention
backend) fused C++ kernels for RMSNorm with the residual add, RoPE in place and the gated activations, in
the same op order. A family adds a file with its plan and a line in the registry (``models/__init__.py``);
one whose layer is more than a plan can say (per-layer inputs) overrides ``make_layer`` and ``forward``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard, single_shard
from cb_serve.kv_cache_interface import StateSpec
from cb_serve.model_executor.layers.attention import AttentionSpec
from cb_serve.model_executor.layers.checkpoint import LazyTensor, copy_parts
from cb_serve.model_executor.layers.embedding import VocabParallelEmbedding
from cb_serve.model_executor.layers.greedy_head import GreedyHead
from cb_serve.model_executor.layers.linear import Linear, find_quant_groups
from cb_serve.model_executor.layers.low_bit_linear import EXACT_LOW_BIT
from cb_serve.model_executor.layers.moe import FusedMoE
from cb_serve.model_executor.layers.rotary import Rope
from cb_serve.model_executor.models.decoder import DecoderLayer
from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan


class CausalLM(nn.Module):
    """``forward`` takes flattened token ids and positions of a ragged batch and returns hidden states;
    ``compute_logits`` runs the final norm and LM head on selected rows. Under tensor parallelism
    (``shard``, ``tp``) it holds one rank's slice of every weight (``cb_serve.distributed.sharding``) and
    every rank returns the full hidden states and logits."""

    @classmethod
    def plan(cls, config) -> ModelPlan:
        """The family's stack for ``config`` (a pure function of it; raises ``ValueError`` for what the
        family does not serve)."""
        raise NotImplementedError(f"{cls.__name__} declares no plan")

    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec | None]:
        """Each layer's attention (None: a recurrent layer), from the plan."""
        return cls.plan(config).attention_specs

    @classmethod
    def kv_shared_layers(cls, config) -> dict[int, int]:
        """Layers keeping no KV cache of their own: layer -> the earlier layer whose KV it reads, from the plan."""
        return cls.plan(config).kv_shared

    def __init__(
        self,
        config,
        backend: AttentionBackend,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        shard: TensorParallelShard | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model_plan = plan = self.plan(config)
        self.shard = shard = shard or single_shard(config)
        self.tp = tp = tp or TensorParallelGroup.single()
        assert shard.size == tp.size and shard.rank == tp.rank
        self.use_cpu_ops = backend.supports_fused_cpu_ops
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, tp)
        self.layers = nn.ModuleList(self.make_layer(i, layer, backend) for i, layer in enumerate(plan.layers))
        self.norm = plan.final_norm(config.hidden_size, config.rms_norm_eps, self.use_cpu_ops)
        self.lm_head = Linear(config.hidden_size, len(shard.vocab), bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self._greedy_head: GreedyHead | bool | None = None  # built at first use, once the weights are packed
        # [tables, max_positions, rotary dim]: one table per kind of layer (``ModelPlan.rope_layer_types``)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    def make_layer(self, index: int, layer: LayerPlan, backend: AttentionBackend) -> nn.Module:
        """Decoder layer ``index`` as planned."""
        return DecoderLayer(self.config, layer, backend, self.shard, self.tp, self.use_cpu_ops)

    def state_specs(self) -> dict[int, StateSpec]:
        """Each recurrent layer's state per sequence (this rank's heads)."""
        return {i: self.layers[i].mixer.spec.state_spec() for i in self.model_plan.state_layers}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``mm_embeds``: (batch indices, rows) replacing those tokens' embeddings (images, unscaled)."""
        x, residual = self.embed(input_ids), None
        if mm_embeds is not None:
            x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
        ropes = [Rope(positions, cos, sin, x.dtype, self.use_cpu_ops) for cos, sin in zip(self.rope_cos, self.rope_sin)]
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            layer_meta = meta if layer.recurrent else meta.for_layer(i)
            x, residual = layer(x, residual, ropes[layer.rope_table], cache, layer_meta)
        return residual + x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, scale = self.embed_tokens(input_ids), self.model_plan.embed_scale
        if scale is None:
            return x
        return x * torch.tensor(scale, dtype=x.dtype) if self.model_plan.embed_scale_in_dtype else x * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        plan = self.model_plan
        logits = self.tp.all_gather(self.lm_head(self.norm(hidden)))  # each rank's vocabulary rows
        if plan.logits_divisor is not None:  # in the model's dtype
            logits = logits / plan.logits_divisor
        if plan.logits_softcap:  # cap * tanh(logits / cap), in the model's dtype
            logits = torch.tanh(logits / plan.logits_softcap) * plan.logits_softcap
        return logits[:, : self.config.vocab_size].float()

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The first maximum of each row of ``compute_logits(hidden)``, bit for bit, from the LM head's
        two-pass argmax (``greedy_head.py``); None where that does not apply. It needs the logits to be the
        LM head's plain output on one rank (``ModelPlan.plain_logits``)."""
        if self._greedy_head is None:
            plain = self.model_plan.plain_logits and type(self).compute_logits is CausalLM.compute_logits
            head = GreedyHead.for_head(self.lm_head, self.config.vocab_size) if plain and self.tp.size == 1 else None
            self._greedy_head = head or False
        if not self._greedy_head or not self._greedy_head.applies(hidden):
            return None
        return self._greedy_head(self.norm(hidden))

    @torch.no_grad()
    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor | LazyTensor]) -> None:
        """This rank's slice of the weights from an HF ``*ForCausalLM`` state dict (or a ``LazyCheckpoint`` of
        the same names, read slice by slice): the embedding, final norm and LM head here, every layer's
        part by its own names (``DecoderLayer.load_hf_weights``)."""
        shard = self.shard

        def vocab_rows(weight: torch.Tensor) -> torch.Tensor:
            rows = weight[shard.vocab.start : min(shard.vocab.stop, weight.shape[0])]  # the last may run past it
            return torch.cat([rows, rows.new_zeros(len(shard.vocab) - len(rows), rows.shape[1])])

        copy_parts(self.embed_tokens.weight, vocab_rows(state["model.embed_tokens.weight"]))
        copy_parts(self.norm.weight, state["model.norm.weight"])
        if not getattr(self.config, "tie_word_embeddings", False):
            head = state["lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"]
            copy_parts(self.lm_head.weight, vocab_rows(head))
        for i, layer in enumerate(self.layers):
            layer.load_hf_weights(state, f"model.layers.{i}.")

    def prepare_for_cpu(self) -> None:
        """CPU weight layouts (``Linear.prepare_for_cpu``) for every projection: stored transposed (plain NN
        GEMMs at prefill sizes) and, with the C++ kernels, packed for ``decode_gemm``; each MoE block prepares
        its own experts and shared expert. A tied LM head keeps the embedding's layout. Exactly-low-bit weights
        keep only their groups (``low_bit_linear``), an exactly-low-bit embedding too (its own, or a tied LM
        head's)."""
        pack = self.use_cpu_ops
        prepare_layers_for_cpu(self.layers, pack)
        extra = [m for name, m in self.named_children() if name not in ("layers", "lm_head") and isinstance(m, Linear)]
        for linear in extra:
            linear.prepare_for_cpu(pack=pack)
        tied = self.lm_head.weight is self.embed_tokens.weight
        self.lm_head.prepare_for_cpu(pack=pack, transpose=not tied)
        if pack and tied and self.lm_head.method is EXACT_LOW_BIT:  # the head's low bits are the rows
            self.embed_tokens.read_rows_from(self.lm_head.decode_weight)
        elif pack and not tied and self.embed_tokens.weight.dtype == torch.float32:
            self.embed_tokens.prepare_for_cpu(find_quant_groups(self.embed_tokens.weight))


def prepare_layers_for_cpu(layers: nn.Module, pack: bool) -> None:
    """Every projection of ``layers`` in its CPU layout: each MoE block prepares its own experts and shared
    expert, every other ``Linear`` itself (``Linear.prepare_for_cpu``)."""
    blocks = [m for m in layers.modules() if isinstance(m, FusedMoE)]
    inside = {id(m) for block in blocks for m in block.modules()}
    for block in blocks:
        block.prepare_for_cpu(pack=pack)
    for m in layers.modules():
        if isinstance(m, Linear) and id(m) not in inside:
            m.prepare_for_cpu(pack=pack)
