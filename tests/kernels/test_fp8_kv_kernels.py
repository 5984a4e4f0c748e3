"""The FP8 (e4m3) KV cache's kernels (``kv_cache_dtype="fp8"``): every code reads back as its value in the C++
decode kernel's vector and generic paths, writes saturate at +-448 instead of becoming NaN on both backends,
and checkpoint scales folded around attention (``KVCacheScales``) give attention over the dequantized cache."""

from __future__ import annotations

import pytest
import torch
from test_cpu_ops import ragged_batch

from cb_serve import cpu_ops
from cb_serve.attention import CpuAttentionBackend, TorchAttentionBackend
from cb_serve.model_executor.layers.kv_cache_scales import KVCacheScales

FP8 = torch.float8_e4m3fn
needs_cpu_ops = pytest.mark.skipif(not cpu_ops.available(), reason="cb_serve CPU kernels did not build here")


def every_code() -> torch.Tensor:
    """The 254 finite e4m3 values (0x7F / 0xFF are NaN), as FP8."""
    codes = torch.arange(256, dtype=torch.int32)
    return codes[(codes & 0x7F) != 0x7F].to(torch.uint8).view(FP8)


@needs_cpu_ops
@pytest.mark.parametrize("head_dim", [64, 128, 256, 32])  # AVX-512 (AVX2) paths, the wide one, the generic one
def test_every_e4m3_code_reads_back_as_its_value(head_dim):
    """One cached token of V per sequence (its softmax weight is exactly 1): the output is the token's V row, so
    each code's float32 value comes back exactly."""
    codes = every_code()
    rows = -(-len(codes) // head_dim)
    v_values = torch.cat([codes, codes[: rows * head_dim - len(codes)]]).view(rows, 1, 1, head_dim)
    v_cache = torch.zeros(rows, 16, 1, head_dim, dtype=FP8)
    v_cache[:, :1] = v_values
    k_cache = torch.ones_like(v_cache)
    q = torch.randn(rows, 2, head_dim)
    block_table = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    out, seq_lens = torch.empty_like(q), torch.ones(rows, dtype=torch.int32)
    torch.ops.cb_serve.paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, 0.1, -1, 0.0, None)
    expected = v_values.view(rows, 1, head_dim).float().expand(rows, 2, head_dim)
    assert torch.equal(out, expected)
    assert torch.equal(every_code().float().abs().max(), torch.tensor(448.0))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_writes_saturate_at_448(backend):
    if backend == "cpu" and not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here")
    attention = TorchAttentionBackend() if backend == "torch" else CpuAttentionBackend()
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=FP8)
    k = torch.tensor([1e6, -1e6, 500.0, 0.1]).repeat(3, 2, 16)
    attention.write_kv(k, -k, cache, torch.tensor([0, 17, 63]))
    written = cache.view(2, -1, 2, 64)[:, [0, 17, 63]].float()
    assert not written.isnan().any()
    expected = torch.tensor([448.0, -448.0, 448.0, 0.1015625]).repeat(3, 2, 16)  # 0.1: its nearest e4m3
    assert torch.equal(written[0], expected) and torch.equal(written[1], -expected)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_checkpoint_scales_fold_around_attention(backend):
    """Keys and values divided by their scales on the way in, the softmax scale times ``k_scale``, the output times
    ``v_scale``: attention over the cache's values times the scales (K/V of 3000 fit e4m3 at k_scale 10)."""
    if backend == "cpu" and not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 64, 16, 40
    query_lens, seq_lens = [1, 1, 1], [70, 33, 5]
    meta = ragged_batch(query_lens, seq_lens, block_size, num_blocks, gen)
    scales, softmax_scale = KVCacheScales(10.0, 0.03), 64**-0.5 / 1000
    k_all = 1000 * torch.randn(sum(seq_lens), kv_heads, head_dim, generator=gen)  # beyond 448: needs the scale
    v_all = 0.01 * torch.randn(sum(seq_lens), kv_heads, head_dim, generator=gen)
    slots = torch.cat([meta.block_table[i, p // block_size].long() * block_size + p % block_size
                       for i, n in enumerate(seq_lens) for p in torch.arange(n).view(-1, 1)])  # fmt: skip
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=FP8)
    attention = TorchAttentionBackend() if backend == "torch" else CpuAttentionBackend()
    attention.write_kv(*scales.scaled_kv(k_all, v_all), cache, slots)  # every token's K/V, as the layers write
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    out = scales.output(attention.forward(q, None, None, cache, meta, scales.softmax_scale(softmax_scale)))
    dequantized = torch.stack([cache[0].float() * scales.k_scale, cache[1].float() * scales.v_scale]).contiguous()
    reference = TorchAttentionBackend().forward(q, None, None, dequantized, meta, softmax_scale)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-4)
    assert (dequantized[0].view(-1, kv_heads, head_dim)[slots] - k_all).abs().max() < 0.07 * 3000  # e4m3's 2^-4


def test_scales_are_read_from_either_name_and_checked():
    state = {f"model.layers.3.self_attn.{n}_scale": torch.tensor(x) for n, x in (("k", 2.0), ("v", 0.5))}
    assert KVCacheScales.read(state, "model.layers.3.self_attn.") == KVCacheScales(2.0, 0.5)
    assert KVCacheScales.read(state, "model.layers.7.self_attn.", source_layer=3) == KVCacheScales(2.0, 0.5)
    assert KVCacheScales.read(state, "model.layers.4.self_attn.") is None
    other = {f"m.layers.0.self_attn.{n}_proj.output_scale": torch.tensor([1.0]) for n in "kv"}
    assert KVCacheScales.read(other, "m.layers.0.self_attn.") is None  # 1.0: nothing to fold
    other["m.layers.0.self_attn.v_proj.output_scale"] = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="must be positive"):
        KVCacheScales.read(other, "m.layers.0.self_attn.")
    other["m.layers.0.self_attn.v_proj.output_scale"] = torch.ones(4)  # one per KV head
    with pytest.raises(ValueError, match="only per-tensor KV-cache scales"):
        KVCacheScales.read(other, "m.layers.0.self_attn.")
