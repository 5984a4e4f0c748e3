"""The C++ CPU kernels (``cb_serve.cpu_ops``) against their PyTorch definitions: the paged
decode attention and KV write against ``TorchAttentionBackend`` (the reference), the fused
layer ops against HF's eager op sequences."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from cb_serve import cpu_ops
from cb_serve.attention import CpuAttentionBackend, TorchAttentionBackend
from cb_serve.attention.base import AttentionMetadata
from cb_serve.model_executor.layers.rotary import rotate_half

if os.environ.get("CB_SERVE_REQUIRE_CPU_OPS") == "1":  # CI: a build failure is an error, not a skip
    assert cpu_ops.available(), f"cb_serve CPU kernels failed to build: {cpu_ops.BUILD_ERROR}"
pytestmark = pytest.mark.skipif(
    not cpu_ops.available(), reason="cb_serve CPU kernels did not build here (no C++ toolchain?)"
)

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def ragged_batch(query_lens, seq_lens, block_size, num_blocks, gen):
    """Metadata for sequences with ``query_lens`` new tokens at the end of ``seq_lens``, whose
    blocks are scattered over the cache in random order."""
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        block_table[i, :nb] = order[used : used + nb].int()
        used += nb
    assert used <= num_blocks
    slots = []
    for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
        slots += [int(block_table[i, p // block_size]) * block_size + p % block_size for p in range(n - q, n)]
    cu_q = torch.tensor([0, *query_lens]).cumsum(0).int()
    return AttentionMetadata(
        num_decodes=sum(q == 1 for q in query_lens),
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=torch.tensor([0, *seq_lens]).cumsum(0).int(),
        seqused_k=torch.tensor(seq_lens, dtype=torch.int32),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# The AVX-512 kernel takes a KV head's query heads 1-4 at a time at head_dim 64 (groups of 1, 2, 3, 4,
# and 6 in two passes of 3) and 1-2 at 128 and 96 (groups of 1, 2, and 4 in two passes); the wide kernel
# 1, 2 or 4 at 256 and 512 (AVX2 too, and 96 there); head_dim 32 takes the generic path.
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (8, 8, 64), (8, 4, 64), (8, 2, 64), (12, 2, 64), (4, 4, 32), (8, 2, 128), (4, 2, 128), (2, 2, 128)]
    + [(4, 2, 96), (3, 3, 96), (4, 1, 256), (8, 4, 256), (3, 3, 256), (6, 1, 256), (8, 2, 512), (2, 2, 512)],
)
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_attention_matches_reference(dtype, heads, kv_heads, head_dim, sliding_window):
    gen = torch.Generator().manual_seed(heads * head_dim + (sliding_window or 0))
    block_size, num_blocks = 16, 160
    # decode rows (longest first, as the model runner orders them; lengths 1 and block multiples
    # included), then prefill chunks with and without cached context
    query_lens = [1] * 7 + [5, 33, 20]
    seq_lens = [300, 257, 64, 33, 16, 2, 1, 40, 33, 100]
    meta = ragged_batch(query_lens, seq_lens, block_size, num_blocks, gen)
    tokens = sum(query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim)  # q, k, v are strided views, as in the model
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cache = rand(2, num_blocks, block_size, kv_heads, head_dim)
    caches = [cache.clone(), cache.clone()]
    outs = [
        backend.forward(q, k, v, c, meta, head_dim**-0.5, sliding_window)
        for backend, c in zip([TorchAttentionBackend(), CpuAttentionBackend()], caches)
    ]
    assert torch.equal(caches[0], caches[1]), "write_kv differs"
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("softcap,sinks", [(1.5, False), (None, True), (1.5, True)])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize(
    "dtype,cache_dtype,heads,kv_heads,head_dim",
    [
        (torch.float32, torch.float32, 12, 2, 64),  # AVX-512 decode, 3 heads a pass; the prefill kernel
        (torch.float32, torch.float32, 8, 2, 128),
        (torch.float32, torch.float32, 4, 4, 32),  # the generic decode, the PyTorch prefill
        (torch.bfloat16, torch.bfloat16, 9, 3, 64),
        (torch.float32, torch.bfloat16, 9, 3, 64),  # a narrower cache
        (torch.float32, torch.float32, 4, 1, 256),  # the wide decode kernel (Gemma 2/3), the prefill kernel
    ],
)
def test_softcap_and_sinks_match_reference(
    dtype, cache_dtype, heads, kv_heads, head_dim, sliding_window, softcap, sinks
):
    """Gemma 2's score soft-cap and gpt-oss's sinks, alone and together, in the decode and prefill
    kernels: the reference's results (itself checked against HF's eager code in test_attention_features)."""
    gen = torch.Generator().manual_seed(heads + head_dim)
    block_size, num_blocks = 16, 80
    query_lens, seq_lens = [1] * 5 + [5, 33, 20], [300, 64, 33, 17, 1, 40, 33, 70]
    meta = ragged_batch(query_lens, seq_lens, block_size, num_blocks, gen)
    tokens = sum(query_lens)
    q = (3 * torch.randn(tokens, heads, head_dim, generator=gen)).to(dtype)  # scores the cap bites on
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    sink_logits = 2 * torch.randn(heads, generator=gen) + 1 if sinks else None
    caches = [cache.clone(), cache.clone()]
    outs = [
        backend.forward(q, k, v, c, meta, head_dim**-0.5, sliding_window, softcap=softcap, sinks=sink_logits)
        for backend, c in zip([TorchAttentionBackend(), CpuAttentionBackend()], caches)
    ]
    tol = TOLERANCE[dtype] if cache_dtype == dtype else 1e-5
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_prefill_kernel_with_images_attending_both_ways(head_dim, sliding_window):
    """Gemma 3's image tokens see their whole image (``bidirectional_spans``): the prefill kernel (its
    ``reach`` per row) equals the reference's mask, for images at a chunk's start, middle and end, across
    16-row tiles, beside rows without images."""
    gen = torch.Generator().manual_seed(head_dim + (sliding_window or 0))
    block_size, num_blocks, heads, kv_heads = 16, 80, 4, 1
    query_lens, seq_lens = [1, 1, 40, 33, 20], [70, 9, 40, 60, 20]
    meta = ragged_batch(query_lens, seq_lens, block_size, num_blocks, gen)
    meta.bidirectional_spans = {2: [(0, 5), (14, 35)], 3: [(50, 60)]}  # row 4: none
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    outs = [backend.forward(q, k, v, cache.clone(), meta, head_dim**-0.5, sliding_window)
            for backend in (TorchAttentionBackend(), CpuAttentionBackend())]  # fmt: skip
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    meta.bidirectional_spans = {}
    causal = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, head_dim**-0.5, sliding_window)
    assert not torch.allclose(causal[2:], outs[0][2:], atol=1e-3), "the spans changed nothing"


@pytest.mark.parametrize(
    "dtype,cache_dtype,head_dim,applies",
    [
        (torch.float32, torch.float32, 64, True),
        (torch.float32, torch.float32, 128, True),
        (torch.float32, torch.float32, 256, True),  # Gemma's heads: the V pass in two slices
        (torch.float32, torch.float32, 32, False),  # head_dim the kernel has no tiles for
        (torch.float32, torch.bfloat16, 64, False),  # a narrower cache: the reference reads unrounded K/V
        (torch.bfloat16, torch.bfloat16, 64, False),
    ],
)
def test_prefill_kernel_takes_the_cases_it_covers(dtype, cache_dtype, head_dim, applies):
    """The backend comparisons above pass whether or not the C++ prefill kernel runs, so check
    which inputs it takes, and that what it declines it leaves untouched."""
    if applies and "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("the prefill kernel needs AVX-512")
    gen = torch.Generator().manual_seed(0)
    meta = ragged_batch([1, 5, 20], [30, 5, 40], 16, 16, gen)
    q = torch.randn(26, 4, head_dim, generator=gen).to(dtype)
    cache = torch.randn(2, 16, 16, 2, head_dim, generator=gen).to(cache_dtype)
    out = torch.full_like(q, float("nan"))
    args = (meta.cu_seqlens_q, meta.seqused_k, meta.block_table, meta.num_decodes, head_dim**-0.5, None)
    assert cpu_ops.paged_prefill_attention(out, q, cache[0], cache[1], *args) is applies
    assert out[:1].isnan().all(), "the decode row is not the prefill kernel's"
    written = ~out[1:].isnan()
    assert written.all() if applies else not written.any()


@pytest.mark.bitwise
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim", [64, 256, 32])  # the AVX-512 path, the wide one and the generic one
def test_attention_over_a_narrower_kv_cache(cache_dtype, head_dim):
    """float32 queries over a bf16/fp16/FP8 KV cache (``kv_cache_dtype``): the same result as the
    reference computing in float32 from the same rounded cache."""
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, block_size, num_blocks = 9, 3, 16, 80
    query_lens, seq_lens = [1] * 5 + [7, 20], [300, 64, 33, 2, 1, 40, 20]
    meta = ragged_batch(query_lens, seq_lens, block_size, num_blocks, gen)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    caches = [cache.clone(), cache.clone()]
    outs = [
        backend.forward(q, k, v, c, meta, head_dim**-0.5, None)
        for backend, c in zip([TorchAttentionBackend(), CpuAttentionBackend()], caches)
    ]
    assert caches[1].dtype == cache_dtype and torch.equal(caches[0], caches[1]), "write_kv differs"
    assert outs[1].dtype == torch.float32
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 34, 700])
def test_layer_ops_match_eager(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    hidden, eps = 96, 1e-5

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    def eager_norm(x, w):  # HF LlamaRMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(dtype)

    tol = dict(atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    x, w, residual = rand(tokens, hidden), 1 + rand(hidden, scale=0.1), rand(tokens, hidden)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, eps), eager_norm(x, w), **tol)
    xx, rr = x.clone(), residual.clone()
    cpu_ops.fused_add_rms_norm(xx, rr, w, eps)
    assert torch.equal(rr, residual + x)
    torch.testing.assert_close(xx, eager_norm(residual + x, w), **tol)

    heads, head_dim, max_pos = 5, 32, 512
    qkv = rand(tokens, (heads + 2) * head_dim)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    cos, sin = torch.randn(max_pos, head_dim, generator=gen), torch.randn(max_pos, head_dim, generator=gen)
    c, s = cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)
    expected = qk * c + rotate_half(qk) * s
    untouched = qkv[:, heads * head_dim :].clone()
    cpu_ops.rotary_embedding(qk, positions, cos, sin)
    assert torch.equal(qk, expected), "RoPE must equal eager PyTorch bit for bit"
    assert torch.equal(qkv[:, heads * head_dim :], untouched)

    gate_up = rand(tokens, 2 * hidden, scale=3.0)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # exp over- and underflow
    gate, up = gate_up.split(hidden, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), F.silu(gate) * up, **tol)
    gelu = F.gelu(gate, approximate="tanh") * up  # Gemma's activation
    torch.testing.assert_close(cpu_ops.gelu_tanh_and_mul(gate_up), gelu, **tol)


def test_kernels_reject_bad_layouts():
    q = torch.randn(2, 4, 8)
    cache = torch.randn(4, 16, 2, 8)
    with pytest.raises(RuntimeError, match="head shapes"):
        cpu_ops.paged_decode_attention(
            torch.empty(2, 4, 8),
            q,
            cache[..., :4].contiguous(),
            cache[..., :4].contiguous(),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
            1.0,
            None,
        )
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_ops.rotary_embedding(q, torch.tensor([0, 99]), torch.randn(10, 8), torch.randn(10, 8))


@pytest.mark.parametrize("vocab", [49152, 1000, 33, 31])
def test_apply_token_bitmask_equals_the_pytorch_path(vocab):
    """The grammar mask in C++ (AVX-512 masked stores, or the bit loop) blocks exactly the tokens
    ``apply_bitmask`` blocks, on the named rows only, never past the vocabulary."""
    from cb_serve.structured_outputs.base import allocate_bitmask, apply_bitmask

    torch.manual_seed(vocab)
    logits = torch.randn(7, vocab)
    bitmask = allocate_bitmask(4, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, dtype=torch.int32))
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # all blocked
    rows = [5, 0, 3]
    expected = logits.clone()
    apply_bitmask(expected, bitmask, rows)
    got = logits.clone()
    cpu_ops.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)
    wide = torch.randn(3, vocab + 64)
    window = wide[:, :vocab]  # rows strided wider than the vocabulary: the columns after it stay
    before = wide[:, vocab:].clone()
    cpu_ops.apply_token_bitmask(window, bitmask, [2])
    assert torch.equal(wide[:, vocab:], before)
    with pytest.raises(RuntimeError):
        cpu_ops.apply_token_bitmask(logits, bitmask, [7])


def argmax_cases(rows: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``[rows, vocab]`` float32 logits of each kind ``argmax_rows`` must get right."""
    inf, nan = float("inf"), float("nan")

    def at_random(x: torch.Tensor, value: float, count: int) -> torch.Tensor:
        for r in range(rows):
            x[r, torch.randint(0, vocab, (count,), generator=gen)] = value
        return x

    edges = [0, vocab // 2 - 1, vocab // 2, vocab - 1]  # a row split in two halves: each side of the cut
    cases = {
        "random": torch.randn(rows, vocab, generator=gen),
        "ties": at_random(torch.randn(rows, vocab, generator=gen), 10.0, 4),
        "few values": torch.randint(-3, 3, (rows, vocab), generator=gen).float(),  # ties everywhere
        "signed zeros": torch.randint(0, 2, (rows, vocab), generator=gen).float().mul(2).sub(1).mul(0.0),
        "all -inf": torch.full((rows, vocab), -inf),
        "-inf and one value": at_random(torch.full((rows, vocab), -inf), -1e30, 1),
        "+inf": at_random(torch.randn(rows, vocab, generator=gen), inf, 2),
        "nan": at_random(torch.randn(rows, vocab, generator=gen), nan, 3),
        "nan and -inf": at_random(at_random(torch.full((rows, vocab), -inf), 5.0, 2), nan, 1),
        "all nan": torch.full((rows, vocab), nan),
    }
    edge_ties, edge_nan = torch.randn(rows, vocab, generator=gen), torch.randn(rows, vocab, generator=gen)
    edge_ties[:, edges[1:]] = 10.0
    edge_nan[:, edges[0]], edge_nan[:, edges[2:]] = 10.0, nan
    mixed = torch.stack([c[r % rows] for r, c in enumerate(cases.values())])[:rows]
    return {**cases, "ties at the edges": edge_ties, "nan after the max": edge_nan, "mixed rows": mixed}


@pytest.mark.bitwise
@pytest.mark.parametrize("rows, vocab", [(1, 262144), (33, 262144), (3, 100003), (5, 2049), (7, 17), (2, 7), (4, 1)])
def test_argmax_rows_equals_torch_max(rows, vocab):
    """``argmax_rows`` (blocked AVX-512 / AVX2 / scalar max, the best block scanned again) equals
    ``logits.max(dim=-1).indices``: the first maximum, the first NaN where a row has one, 0 for -inf rows."""
    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    for kind, logits in argmax_cases(rows, vocab, gen).items():
        got = cpu_ops.argmax_rows(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.max(dim=-1).indices), kind
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_ops.argmax_rows(torch.randn(4, 9)[:, :8])


def test_greedy_sampler_takes_the_kernel_with_torch_picks():
    """The sampler's greedy pick: ``argmax_rows`` for contiguous float32 CPU logits, ``max`` for the rest."""
    from cb_serve.model_executor.sampler import greedy_tokens

    logits = torch.randn(6, 5000)
    logits[:, 7] = logits[:, 4000] = 50.0
    assert greedy_tokens(logits).tolist() == [7] * 6
    assert greedy_tokens(logits[:, ::2]).tolist() == logits[:, ::2].max(dim=-1).indices.tolist()
    assert greedy_tokens(logits.double()).tolist() == [7] * 6


@pytest.mark.bitwise
@pytest.mark.parametrize("tokens", [1, 33])
def test_gemma_norm_kernel_matches_hf(tokens):
    """``GemmaRMSNorm`` with the C++ kernel (float32: Llama's kernel with weight ``1 + w``) against HF's
    ``Gemma3RMSNorm``: hidden states, strided q heads of a fused projection, the fused residual add, a
    weight loaded in place after the first call; bfloat16 keeps the PyTorch ops, bit for bit HF's."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from cb_serve.model_executor.layers.norm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(tokens)
    tol = dict(atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    with torch.no_grad():
        for dim, x in [(96, torch.randn(tokens, 96, generator=gen)), (32, torch.randn(tokens, 7, 32, generator=gen))]:
            x = x[:, :5] if x.dim() == 3 else x  # heads strided as q's in qkv
            ours, hf = GemmaRMSNorm(dim, 1e-6, use_cpu_ops=True), Gemma3RMSNorm(dim, eps=1e-6)
            for _ in range(2):  # the second time with a new weight, copied in as the loader does
                w = 0.5 * torch.randn(dim, generator=gen)
                ours.weight.copy_(w), hf.weight.copy_(w)
                torch.testing.assert_close(ours(x), hf(x), **tol)
                assert torch.equal(ours.one_plus_weight(), 1.0 + w)
            if x.dim() == 2:
                residual = torch.randn(tokens, dim, generator=gen)
                out, new_residual = ours(x.clone(), residual.clone())
                assert torch.equal(new_residual, residual + x)
                torch.testing.assert_close(out, hf(residual + x), **tol)
            ours, hf = ours.bfloat16(), hf.bfloat16()
            assert torch.equal(ours(x.bfloat16()), hf(x.bfloat16()))
