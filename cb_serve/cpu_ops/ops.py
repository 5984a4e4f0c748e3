"""Thin typed wrappers over the C++ ops (``torch.ops.cb_serve.*``, built by ``cpu_ops.available()`` and
its optional builds): what each computes, on what shapes and dtypes. Re-exported from ``cb_serve.cpu_ops``."""

from __future__ import annotations

import torch


def decode_gemm_isa() -> str:
    """The instruction set the native ``decode_gemm`` was compiled for: avx512, avx2 or scalar."""
    return str(torch.ops.cb_serve.decode_gemm_isa())


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """``out[i]`` = softmax attention of the single query ``q[i]`` (``[N, H, D]``) over the first
    ``seq_lens[i]`` tokens (the last ``sliding_window`` of them, if set) of sequence ``i``, whose
    blocks ``block_table[i]`` live in ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, KVH, D]``);
    scores soft-capped at ``softcap`` and float32 ``sinks`` ``[H]`` in the denominator where given."""
    torch.ops.cb_serve.paged_decode_attention(
        out, q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window or 0, softcap or 0.0, sinks
    )


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    first_seq: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    reach: torch.Tensor | None = None,
) -> bool:
    """Causal attention of sequences ``first_seq..`` (query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``,
    the last of the ``seq_lens[i]`` keys in the cache) into ``out``; False, with ``out`` untouched,
    where the kernel does not apply (not float32 queries and cache, head_dim not 64, 128 or 256, no
    AVX-512). ``reach`` (int32 ``[T]``): each query row's last visible key position, beyond its own
    where its image's later tokens are (``bidirectional_reach``)."""
    return torch.ops.cb_serve.paged_prefill_attention(
        out,
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_table,
        first_seq,
        scale,
        sliding_window or 0,
        softcap or 0.0,
        sinks,
        reach,
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``k_cache`` / ``v_cache`` slot ``slot_mapping[i]`` = ``k[i]`` / ``v[i]`` (``[T, KVH, D]``)."""
    torch.ops.cb_serve.write_kv(k, v, k_cache, v_cache, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ops.cb_serve.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``."""
    torch.ops.cb_serve.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on ``qk`` (``[T, heads, D]``): ``x * cos + rotate_half(x) * sin`` at ``positions``."""
    torch.ops.cb_serve.rotary_embedding(qk, positions, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]``."""
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    torch.ops.cb_serve.silu_and_mul(out, x)
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[:, :I], approximate="tanh") * x[:, I:]``."""
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    torch.ops.cb_serve.gelu_tanh_and_mul(out, x)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``structured_outputs.base.apply_bitmask`` for float32 logits on the CPU."""
    torch.ops.cb_serve.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.max(dim=-1).indices`` of a contiguous float32 ``[N, V]``: per row the first maximum's
    index (the first NaN's where the row has one), int64 ``[N]``; one read of each row."""
    return torch.ops.cb_serve.argmax_rows(logits)


def pack_decode_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``[N, K]`` weight as ``decode_gemm`` reads it: tiles of 32 output columns, each
    ``[K, 32]`` and contiguous (zero-padded to a multiple of 32 columns)."""
    return torch.ops.cb_serve.pack_decode_weight(weight)


def decode_gemm(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, isa: str | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a small float32 batch ``x`` (``[M, K]``, contiguous), from the
    packed weight (``pack_decode_weight``, or ``exact_quant.pack_decode_weight_quantized``: the same
    result from 4 or 8 bits): every weight byte read once per call, FMA chains in k order
    (batch-invariant, the same bits from every build). ``isa``: run ``decode_gemm_variant(isa)``."""
    out = x.new_empty(x.shape[0], out_features)
    op = torch.ops.cb_serve.decode_gemm if isa is None else getattr(torch.ops.cb_serve, f"decode_gemm_{isa}")
    op(out, x, packed, bias)
    return out


def lora_apply(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    """In place, for each token ``t`` with slot ``s = token_slots[t] >= 0`` and ``r = ranks[s]``:
    ``out[t] += (a_stack[s, :r] @ x[t]) @ b_stack[s, :r]`` (float32; ``x`` ``[T, K]`` contiguous,
    ``a_stack`` ``[S, R, K]``, ``b_stack`` ``[S, R, N]``; every adapter of a step in one call)."""
    torch.ops.cb_serve.lora_apply(out, x, a_stack, b_stack, token_slots, ranks)


def amx_gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for float32 ``x`` (``[M, K]``, contiguous) on AMX tiles, from the 4- or 8-bit
    groups as ``exact_quant.pack_amx_weight`` lays them out: float32-accurate (each output a float32 sum of
    exact products), faster than ``decode_gemm`` from ~13 rows and than MKL's float32 GEMM at any larger
    size (``amx_available()`` only)."""
    out = x.new_empty(x.shape[0], out_features)
    torch.ops.cb_serve.amx_gemm(out, x, packed, bias)
    return out


def amx_pair_max(x: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[M, ceil(vocab / 32)]``: per row of ``x`` and pair of column tiles (32 columns, those below
    ``vocab``), the maximum of ``bf16(x) @ bf16(weight).T`` with float32 sums (each factor within 2^-8 of its
    value), from an 8-bit ``pack_amx_weight`` (``amx_available()`` only): the greedy head's first pass."""
    out = x.new_empty(x.shape[0], (vocab + 31) // 32)
    torch.ops.cb_serve.amx_pair_max(out, x, packed, vocab)
    return out


def int8_tile_max(xu: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[M, tiles]``: per row and tile of 32 columns (those below ``vocab``; -inf where none), the
    largest approximate logit ``sum_g d[g] * scales[:, g] * (xq_g . q_g)`` (each group's dot exact in int32)
    from ``xu`` (int32 ``[M, G, 8]``: the bytes ``xq + 128``, xq in -127..127) and an 8-bit
    ``pack_decode_weight_quantized`` layout (``int8_tile_max_available()`` only): the greedy head's first
    pass without AMX."""
    out = xu.new_empty(xu.shape[0], packed.shape[0], dtype=torch.float32)
    torch.ops.cb_serve.int8_tile_max(out, xu, scales, packed, vocab)
    return out


def bf16_gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``amx_gemm``'s product on AVX512-BF16 (``bf16_available()`` only), every partial sum exact: bit for bit
    ``exact_quant.split_gemm_reference``."""
    out = x.new_empty(x.shape[0], out_features)
    torch.ops.cb_serve.bf16_gemm(out, x, packed, bias)
    return out
