"""Compact Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a ragged, paged batch.

The math follows HF transformers' modeling code op for op (RMSNorm in float32, rotate-half
RoPE, residual order) so float32 greedy outputs match ``model.generate`` token for token;
the layout differs where it is faster: fused QKV and gate/up projections, flattened tokens,
and (with the ``cpu`` attention backend) fused C++ kernels for RMSNorm with the residual add,
RoPE in place and SiLU-and-mul (``cb_serve.cpu_ops``), in the same op order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard, single_shard
from cb_serve.kv_cache_interface import StateSpec
from cb_serve.model_executor.layers.attention import Attention, AttentionSpec, layer_windows
from cb_serve.model_executor.layers.checkpoint import LazyTensor, materialize
from cb_serve.model_executor.layers.embedding import VocabParallelEmbedding
from cb_serve.model_executor.layers.greedy_head import GreedyHead
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.layers.mlp import GatedMLP
from cb_serve.model_executor.layers.moe import FusedMoE
from cb_serve.model_executor.layers.norm import RMSNorm
from cb_serve.model_executor.layers.rotary import Rope


class DecoderLayer(nn.Module):
    """Takes and returns ``(x, residual)``: the hidden state is ``residual + x``, and the add
    happens inside the next norm (HF: ``h = h + attn(norm(h)); h = h + mlp(norm(h))``)."""

    norm: type[RMSNorm] = RMSNorm

    def __init__(self, config, attention: Attention, mlp: nn.Module) -> None:
        super().__init__()
        fused = attention.use_cpu_ops
        self.input_layernorm = self.norm(config.hidden_size, config.rms_norm_eps, fused)
        self.self_attn = attention
        self.post_attention_layernorm = self.norm(config.hidden_size, config.rms_norm_eps, fused)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """``forward`` takes flattened token ids and positions of a ragged batch and returns
    hidden states; ``compute_logits`` runs the final norm and LM head on selected rows.
    Under tensor parallelism (``shard``, ``tp``) it holds one rank's slice of every weight
    (``cb_serve.distributed.sharding``) and every rank returns the full hidden states and logits."""

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
        self.shard = shard = shard or single_shard(config)
        self.tp = tp = tp or TensorParallelGroup.single()
        assert shard.size == tp.size and shard.rank == tp.rank
        self.use_cpu_ops = backend.supports_fused_cpu_ops
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.make_layer(i, spec, backend) for i, spec in enumerate(self.attention_specs(config))
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, self.use_cpu_ops)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.lm_head = Linear(config.hidden_size, len(shard.vocab), bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self._greedy_head: GreedyHead | bool | None = None  # built at first use, once the weights are packed
        # [tables, max_positions, rotary dim]: one table per kind of layer (``rope_layer_types``)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    decoder_layer: type[nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm
    # HF's rotary module returns cos/sin for half the rotary dims, each applied to both halves (gpt-oss)
    rope_half_tables: bool = False

    @classmethod
    def rope_layer_types(cls, config) -> list[str] | None:
        """The layer types whose RoPE tables differ (HF's rotary module takes a ``layer_type``), in
        table order; None: one table for every layer."""
        return None

    @classmethod
    def state_layers(cls, config) -> tuple[int, ...]:
        """Recurrent layers: a state slot per sequence instead of KV (``kv_cache_interface.StateSpec``)."""
        return ()

    def state_specs(self) -> dict[int, StateSpec]:
        """Each recurrent layer's state per sequence (this rank's heads)."""
        return {}

    @classmethod
    def kv_shared_layers(cls, config) -> dict[int, int]:
        """Layers without a KV cache of their own: layer -> the earlier layer whose KV it reads (Gemma 4)."""
        return {}

    def make_layer(self, index: int, spec: AttentionSpec, backend: AttentionBackend) -> nn.Module:
        """Decoder layer ``index`` with attention ``spec`` (a model whose layers differ overrides it)."""
        config, shard, tp = self.config, self.shard, self.tp
        attention = Attention(config, backend, spec, shard, tp)
        return self.decoder_layer(config, attention, self.make_mlp(index))

    def make_mlp(self, index: int) -> nn.Module:
        """Layer ``index``'s feed-forward block: the gated MLP, or (in a mixture-of-experts model) ``FusedMoE``."""
        return GatedMLP(self.config, self.shard, self.tp, self.use_cpu_ops)

    @classmethod
    def attention_specs(cls, config) -> list[AttentionSpec]:
        """Each layer's attention: its sliding window and the architecture's biases and norms."""
        bias = getattr(config, "attention_bias", False)
        return [AttentionSpec(window, bias, bias) for window in layer_windows(config)]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        ropes = [Rope(positions, cos, sin, x.dtype, self.use_cpu_ops) for cos, sin in zip(self.rope_cos, self.rope_sin)]
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, ropes[layer.self_attn.rope_table], kv_cache, meta.for_layer(i))
        return residual + x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(self.lm_head(self.norm(hidden)))  # each rank's vocabulary rows
        if self.final_logit_softcapping:  # Gemma 2: cap * tanh(logits / cap), in the model's dtype
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits[:, : self.config.vocab_size].float()

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The first maximum of each row of ``compute_logits(hidden)``, bit for bit, from the LM head's
        two-pass argmax (``greedy_head.py``); None where that does not apply. It needs the logits to be the
        LM head's plain output on one rank (no soft-cap, no scaling: no override of ``compute_logits``)."""
        if self._greedy_head is None:
            plain = type(self).compute_logits is LlamaForCausalLM.compute_logits and not self.final_logit_softcapping
            head = GreedyHead.for_head(self.lm_head, self.config.vocab_size) if plain and self.tp.size == 1 else None
            self._greedy_head = head or False
        if not self._greedy_head or not self._greedy_head.applies(hidden):
            return None
        return self._greedy_head(self.norm(hidden))

    @torch.no_grad()
    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor | LazyTensor]) -> None:
        """Copy this rank's slice of the weights from an HF ``*ForCausalLM`` state dict (or a
        ``LazyCheckpoint`` of the same names, read slice by slice), fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
        shard = self.shard

        def put(name: str, *parts: torch.Tensor) -> None:  # parts of a lazy checkpoint are read here
            own[name].copy_(torch.cat([materialize(p) for p in parts], dim=0))

        def vocab_rows(weight: torch.Tensor) -> torch.Tensor:
            rows = weight[shard.vocab.start : min(shard.vocab.stop, weight.shape[0])]  # the last may run past it
            return torch.cat([rows, rows.new_zeros(len(shard.vocab) - len(rows), rows.shape[1])])

        put("embed_tokens.weight", vocab_rows(state["model.embed_tokens.weight"]))
        put("norm.weight", state["model.norm.weight"])
        if not getattr(self.config, "tie_word_embeddings", False):
            head = state["lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"]
            put("lm_head.weight", vocab_rows(head))
        for i, layer in enumerate(self.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            # every norm (Gemma has four per layer), by HF's name, but those of blocks that load themselves
            loads_itself = tuple(n + "." for n, m in layer.named_modules() if n and hasattr(m, "load_hf_weights"))
            for name, _ in layer.named_parameters():
                if name.endswith("norm.weight") and not name.startswith(loads_itself):
                    put(dst + name, state[src + name])
            self.load_mixer_weights(layer, state, src, dst, put)
            self.load_mlp_weights(layer, state, src, dst, put)

    def load_mixer_weights(self, layer: nn.Module, state: Mapping, src: str, dst: str, put) -> None:
        """Layer ``src``'s attention (this rank's heads) into ``layer`` (a recurrent model overrides it)."""
        attn, w, shard, head_dim = src + "self_attn.", state.__getitem__, self.shard, layer.self_attn.head_dim
        q = slice(shard.q_heads.start * head_dim, shard.q_heads.stop * head_dim)
        kv = slice(shard.kv_heads.start * head_dim, shard.kv_heads.stop * head_dim)
        q_weight, gate = w(attn + "q_proj.weight"), ()
        if layer.self_attn.output_gate:  # rows [q_h | gate_h] per head (Qwen3.5, Qwen3-Next)
            both = materialize(q_weight).view(-1, 2, head_dim, q_weight.shape[-1])
            q_weight, gate = both[:, 0].flatten(0, 1), (both[:, 1].flatten(0, 1)[q],)
        qkv = (q_weight[q], w(attn + "k_proj.weight")[kv], w(attn + "v_proj.weight")[kv], *gate)
        put(dst + "self_attn.qkv_proj.weight", *qkv)
        put(dst + "self_attn.o_proj.weight", w(attn + "o_proj.weight")[:, q])
        if layer.self_attn.qkv_proj.bias is not None:
            qkv = (w(attn + "q_proj.bias")[q], w(attn + "k_proj.bias")[kv], w(attn + "v_proj.bias")[kv])
            put(dst + "self_attn.qkv_proj.bias", *qkv)
        if layer.self_attn.o_proj.bias is not None:  # the driver's alone: added once
            put(dst + "self_attn.o_proj.bias", w(attn + "o_proj.bias"))
        if layer.self_attn.sinks is not None:  # one logit per query head: this rank's heads
            put(dst + "self_attn.sinks", w(attn + "sinks")[shard.q_heads.start : shard.q_heads.stop])

    def load_mlp_weights(self, layer: nn.Module, state: Mapping, src: str, dst: str, put) -> None:
        """Layer ``src``'s feed-forward block: the gated MLP's columns of this rank, or the MoE block."""
        if isinstance(layer.mlp, FusedMoE):
            layer.mlp.load_hf_weights(state, src)
            return
        w, mlp = state.__getitem__, slice(self.shard.intermediate.start, self.shard.intermediate.stop)
        gate_up = w(src + "mlp.gate_proj.weight")[mlp], w(src + "mlp.up_proj.weight")[mlp]
        put(dst + "mlp.gate_up_proj.weight", *gate_up)
        put(dst + "mlp.down_proj.weight", w(src + "mlp.down_proj.weight")[:, mlp])
        if layer.mlp.gate_up_proj.bias is not None:
            put(dst + "mlp.gate_up_proj.bias", w(src + "mlp.gate_proj.bias")[mlp], w(src + "mlp.up_proj.bias")[mlp])
        if layer.mlp.down_proj.bias is not None:
            put(dst + "mlp.down_proj.bias", w(src + "mlp.down_proj.bias"))

    def prepare_for_cpu(self) -> None:
        """CPU weight layouts: projections stored transposed (plain NN GEMMs at prefill sizes)
        and, with the C++ kernels, copies packed for ``decode_gemm`` at decode sizes (see ``Linear``)."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            dense = () if isinstance(mlp, FusedMoE) else (mlp.gate_up_proj, mlp.down_proj)
            for linear in (attn.qkv_proj, attn.o_proj, *dense):
                linear.prepare_for_cpu(pack=self.use_cpu_ops)
            if isinstance(mlp, FusedMoE):
                mlp.prepare_for_cpu(pack=self.use_cpu_ops)
        tied = self.lm_head.weight is self.embed_tokens.weight
        self.lm_head.prepare_for_cpu(pack=self.use_cpu_ops, transpose=not tied)
