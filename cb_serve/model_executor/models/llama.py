"""Compact Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a ragged, paged batch.

The math follows HF transformers' modeling code op for op (RMSNorm in float32, rotate-half
RoPE, residual order) so float32 greedy outputs match ``model.generate`` token for token;
the layout differs where it is faster: fused QKV and gate/up projections, flattened tokens,
and (with the ``cpu`` attention backend) fused C++ kernels for RMSNorm with the residual add,
RoPE in place and SiLU-and-mul (``cb_serve.cpu_ops``), in the same op order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.attention.base import AttentionBackend, AttentionMetadata
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard, single_shard
from cb_serve.model_executor.checkpoint import LazyTensor, materialize
from cb_serve.model_executor.linear import Linear


class RMSNorm(nn.Module):
    """``norm(x)``, or with a residual ``(norm(residual + x), residual + x)`` (vLLM's fused form)."""

    def __init__(self, hidden_size: int, eps: float, use_cpu_ops: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_cpu_ops = use_cpu_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return cpu_ops.rms_norm(x, self.weight, self.eps) if self.use_cpu_ops else self._norm(x)
        if self.use_cpu_ops:
            cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """This rank's heads (``shard``); the output projection's partial sums are reduced over ranks."""

    def __init__(
        self,
        config,
        backend: AttentionBackend,
        sliding_window: int | None,
        qkv_bias: bool,
        o_bias: bool,
        shard: TensorParallelShard,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.num_heads = len(shard.q_heads)
        self.num_kv_heads = len(shard.kv_heads)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend = backend
        self.use_cpu_ops = backend.supports_fused_cpu_ops
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias and shard.is_driver)  # added once
        self.tp = tp

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = rope.apply(qk)  # on q and k heads at once
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return self.tp.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))


class MLP(nn.Module):
    """This rank's intermediate columns; the down projection's partial sums are reduced over ranks."""

    def __init__(self, config, shard: TensorParallelShard, tp: TensorParallelGroup, use_cpu_ops: bool = False) -> None:
        super().__init__()
        self.use_cpu_ops = use_cpu_ops
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = len(shard.intermediate)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=bias and shard.is_driver)
        self.tp = tp
        if config.hidden_act != "silu":
            raise ValueError(f"Unsupported activation {config.hidden_act!r} (only silu).")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gate_up_proj(x)
        if self.use_cpu_ops:
            return self.tp.all_reduce(self.down_proj(cpu_ops.silu_and_mul(x)))
        gate, up = x.split(self.intermediate_size, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    """Takes and returns ``(x, residual)``: the hidden state is ``residual + x``, and the add
    happens inside the next norm (HF: ``h = h + attn(norm(h)); h = h + mlp(norm(h))``)."""

    def __init__(self, config, attention: Attention, mlp: MLP) -> None:
        super().__init__()
        fused = attention.use_cpu_ops
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
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
        qkv_bias, o_bias = self.attention_biases(config)
        windows = sliding_windows(config)
        self.use_cpu_ops = backend.supports_fused_cpu_ops
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                Attention(config, backend, windows[i], qkv_bias, o_bias, shard, tp),
                MLP(config, shard, tp, self.use_cpu_ops),
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.use_cpu_ops)
        self.lm_head = Linear(config.hidden_size, len(shard.vocab), bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cos", rope_cos, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        """Whether q/k/v and o projections have biases."""
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = Rope(positions, self.rope_cos, self.rope_sin, x.dtype, self.use_cpu_ops)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return residual + x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(self.lm_head(self.norm(hidden)))  # each rank's vocabulary rows
        return logits[:, : self.config.vocab_size].float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor | LazyTensor]) -> None:
        """Copy this rank's slice of the weights from an HF ``*ForCausalLM`` state dict (or a
        ``LazyCheckpoint`` of the same names, read slice by slice), fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
        shard, head_dim = self.shard, self.layers[0].self_attn.head_dim
        q = slice(shard.q_heads.start * head_dim, shard.q_heads.stop * head_dim)
        kv = slice(shard.kv_heads.start * head_dim, shard.kv_heads.stop * head_dim)
        mlp = slice(shard.intermediate.start, shard.intermediate.stop)

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
            attn, w = src + "self_attn.", state.__getitem__
            put(dst + "input_layernorm.weight", w(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", w(src + "post_attention_layernorm.weight"))
            qkv = (w(attn + "q_proj.weight")[q], w(attn + "k_proj.weight")[kv], w(attn + "v_proj.weight")[kv])
            put(dst + "self_attn.qkv_proj.weight", *qkv)
            put(dst + "self_attn.o_proj.weight", w(attn + "o_proj.weight")[:, q])
            gate_up = w(src + "mlp.gate_proj.weight")[mlp], w(src + "mlp.up_proj.weight")[mlp]
            put(dst + "mlp.gate_up_proj.weight", *gate_up)
            put(dst + "mlp.down_proj.weight", w(src + "mlp.down_proj.weight")[:, mlp])
            if layer.self_attn.qkv_proj.bias is not None:
                qkv = (w(attn + "q_proj.bias")[q], w(attn + "k_proj.bias")[kv], w(attn + "v_proj.bias")[kv])
                put(dst + "self_attn.qkv_proj.bias", *qkv)
            if layer.self_attn.o_proj.bias is not None:  # the driver's alone: added once
                put(dst + "self_attn.o_proj.bias", w(attn + "o_proj.bias"))
            if layer.mlp.gate_up_proj.bias is not None:
                put(dst + "mlp.gate_up_proj.bias", w(src + "mlp.gate_proj.bias")[mlp], w(src + "mlp.up_proj.bias")[mlp])
            if layer.mlp.down_proj.bias is not None:
                put(dst + "mlp.down_proj.bias", w(src + "mlp.down_proj.bias"))

    def prepare_for_cpu(self) -> None:
        """CPU weight layouts: projections stored transposed (plain NN GEMMs at prefill sizes)
        and, with the C++ kernels, copies packed for ``decode_gemm`` at decode sizes (see ``Linear``)."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                linear.prepare_for_cpu(pack=self.use_cpu_ops)
        tied = self.lm_head.weight is self.embed_tokens.weight
        self.lm_head.prepare_for_cpu(pack=self.use_cpu_ops, transpose=not tied)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q/k/v (not on o_proj)."""

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of this rank's vocabulary shard: a token outside it looks up zeros, and
    the sum over ranks is the full lookup. One rank is a plain embedding."""

    def __init__(self, shard: TensorParallelShard, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__(len(shard.vocab), hidden_size)
        self.vocab_start, self.tp = shard.vocab.start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class Rope:
    """Rotate-half RoPE for one step's ``positions``: in place by the C++ kernel (straight from
    the float32 tables) or, in PyTorch, with the step's cos/sin rows gathered once for all layers."""

    def __init__(self, positions, cos_table, sin_table, dtype: torch.dtype, use_cpu_ops: bool) -> None:
        self.positions, self.use_cpu_ops = positions, use_cpu_ops
        if use_cpu_ops:
            self.cos, self.sin = cos_table, sin_table
        else:
            self.cos = cos_table[positions].unsqueeze(1).to(dtype)
            self.sin = sin_table[positions].unsqueeze(1).to(dtype)

    def apply(self, qk: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_ops:
            cpu_ops.rotary_embedding(qk, self.positions, self.cos, self.sin)
            return qk
        return qk * self.cos + rotate_half(qk) * self.sin


def sliding_windows(config) -> list[int | None]:
    """Per-layer sliding window (``None``: full attention), as HF's modeling code applies it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * config.num_hidden_layers
