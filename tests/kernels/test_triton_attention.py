"""The Triton attention backend against the PyTorch reference on ragged paged batches built like the
model runner builds them. Without CUDA the kernels run in the Triton interpreter (conftest sets
``TRITON_INTERPRET=1``), so shapes stay small."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the triton attention backend needs the triton package")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set before triton was imported", allow_module_level=True)

from cb_serve.attention.base import AttentionMetadata  # noqa: E402
from cb_serve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from cb_serve.attention.triton_backend import TritonAttentionBackend, build_tile_plan  # noqa: E402


def build_meta(
    query_lens: list[int], seq_lens: list[int], block_table: np.ndarray, block_size: int, device
) -> AttentionMetadata:
    """``AttentionMetadata`` as ``ModelRunner.prepare`` builds it; rows with ``seq_len == 0`` are graph
    padding rows (slot -1)."""
    q_lens, s_lens = np.asarray(query_lens), np.asarray(seq_lens)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    cu_k = np.concatenate([[0], np.cumsum(s_lens)])
    row = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.arange(cu_q[-1]) - cu_q[:-1][row] + (s_lens - q_lens)[row]
    slots = block_table[row, np.maximum(positions, 0) // block_size] * block_size + positions % block_size
    slots[s_lens[row] == 0] = -1

    def tensor(a, dtype=torch.int32) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=dtype, device=device)

    return AttentionMetadata(
        num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens)),
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        cu_seqlens_q=tensor(cu_q),
        cu_seqlens_k=tensor(cu_k),
        seqused_k=tensor(s_lens),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(s_lens.max()),
        block_table=tensor(block_table),
        slot_mapping=tensor(slots, torch.int64),
    )


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_table: np.ndarray
    block_size: int

    def meta(self, rows: int | None = None) -> AttentionMetadata:
        rows = len(self.query_lens) if rows is None else rows
        bt = self.block_table[:rows]
        return build_meta(self.query_lens[:rows], self.seq_lens[:rows], bt, self.block_size, self.q.device)

    def tokens(self, rows: int) -> int:
        return sum(self.query_lens[:rows])


def make_batch(specs, heads, kv_heads, head_dim, block_size, dtype, device="cpu", pad_rows=0, seed=0) -> Batch:
    """``specs``: (context_len, query_len) per sequence, one-token rows first; blocks are a random
    permutation of the cache (block 0 included), the cache is random (stale context), and the block
    table has a spare column of 0 padding. ``pad_rows`` graph padding rows go last."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [q for _, q in specs] + [1] * pad_rows
    seq_lens = [c + q for c, q in specs] + [0] * pad_rows
    counts = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(counts) + 3
    perm = torch.randperm(num_blocks, generator=gen).numpy()
    block_table = np.zeros((len(seq_lens), max(counts) + 1), dtype=np.int64)
    ends = np.cumsum(counts)
    for i, (n, end) in enumerate(zip(counts, ends)):
        block_table[i, :n] = perm[end - n : end]
    t = sum(query_lens)

    def rand(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    qkv = rand(t, heads + 2 * kv_heads, head_dim)  # strided views of one projection, as in the model
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    kv_cache = rand(2, num_blocks, block_size, kv_heads, head_dim)
    return Batch(q, k, v, kv_cache, query_lens, seq_lens, block_table, block_size)


def reference(
    b: Batch, rows: int, scale: float, window: int | None, dtype=None, **extra
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch backend's output and cache on the first ``rows`` rows (optionally upcast); ``extra``:
    ``softcap`` and ``sinks``."""
    t = b.tokens(rows)
    dtype = dtype or b.q.dtype
    cache = b.kv_cache.to(dtype)
    out = TorchAttentionBackend().forward(
        b.q[:t].to(dtype), b.k[:t].to(dtype), b.v[:t].to(dtype), cache, b.meta(rows), scale, window, **extra
    )
    return out, cache


# Tests on CPU tensors run the kernels in Triton's interpreter. On a CUDA machine the interpreter is
# off unless TRITON_INTERPRET=1 was set before triton was imported (it decides per process), so there
# they skip and the CUDA tests below cover the kernels; TRITON_INTERPRET=1 pytest runs both.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
)


# (id, specs, heads, kv_heads, head_dim, block_size, window, num_splits)
CASES = [
    ("decode-g1", [(70, 1), (33, 1), (4, 1)], 2, 2, 64, 16, None, 1),
    ("decode-g3-split", [(100, 1), (64, 1), (15, 1)], 9, 3, 64, 32, None, 3),
    ("decode-window-split", [(150, 1), (31, 1)], 4, 1, 64, 16, 40, 4),
    ("prefill-g4", [(0, 37), (0, 20)], 8, 2, 64, 16, None, None),
    ("chunked-g3-split", [(45, 30), (16, 16)], 9, 3, 64, 32, None, 3),
    ("prefill-window-split", [(0, 50), (20, 9)], 2, 2, 64, 16, 16, 2),
    ("mixed-g3-d80", [(50, 1), (20, 1), (33, 25), (0, 18)], 6, 2, 80, 16, None, 2),
    ("mixed-g4-d32-window", [(90, 1), (10, 1), (60, 40)], 4, 1, 32, 32, 24, 2),
    ("mixed-window1", [(20, 1), (5, 17)], 2, 1, 64, 16, 1, None),
    ("decode-long-auto-split", [(700, 1)], 4, 1, 64, 16, None, None),
    ("chunked-block128", [(100, 40), (0, 70)], 3, 1, 64, 128, 1000, None),
]
DTYPES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def check_case(case, dtype: torch.dtype, device: str, tol: dict, ref_dtype=None, **extra) -> None:
    _, specs, heads, kv_heads, head_dim, block_size, window, splits = case
    b = make_batch(specs, heads, kv_heads, head_dim, block_size, dtype, device=device)
    scale = head_dim**-0.5
    ref_out, ref_cache = reference(b, len(specs), scale, window, ref_dtype, **extra)
    cache = b.kv_cache.clone()
    out = TritonAttentionBackend(num_splits=splits).forward(b.q, b.k, b.v, cache, b.meta(), scale, window, **extra)
    assert out.dtype == dtype and out.shape == b.q.shape
    torch.testing.assert_close(cache.to(ref_cache.dtype), ref_cache, atol=tol["atol"], rtol=0)
    torch.testing.assert_close(out.to(ref_out.dtype), ref_out, **tol)


@interpreted
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_backend(case, dtype):
    check_case(case, dtype, "cpu", DTYPES[dtype])


# Soft-cap (Gemma 2) and sinks (gpt-oss), alone and together: decode split over programs (the sink
# counted once), prefill and mixed steps, with and without a window.
FEATURE_CASES = [CASES[i] for i in (1, 2, 5, 6, 7)]
FEATURES = [(0.5, False), (None, True), (0.5, True)]


def sinks_for(case, device: str = "cpu") -> torch.Tensor:
    return (2 * torch.randn(case[2], generator=torch.Generator().manual_seed(7)) + 1).to(device)


@interpreted
@pytest.mark.parametrize("softcap,sinks", FEATURES)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_softcap_and_sinks_match_torch_backend(case, softcap, sinks):
    check_case(
        case, torch.float32, "cpu", DTYPES[torch.float32], softcap=softcap, sinks=sinks_for(case) if sinks else None
    )


@interpreted
@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches(seed):
    rng = np.random.default_rng(seed)
    decodes = [(int(c), 1) for c in sorted(rng.integers(0, 150, rng.integers(0, 4)), reverse=True)]
    prefills = [(int(rng.integers(0, 80)) * (rng.random() < 0.7), int(rng.integers(2, 40))) for _ in range(2)]
    kv_heads, group = int(rng.integers(1, 3)), int(rng.choice([1, 3, 4]))
    window = None if rng.random() < 0.5 else int(rng.integers(1, 60))
    head_dim, block_size, splits = int(rng.choice([32, 64, 80])), int(rng.choice([16, 32])), int(rng.integers(1, 4))
    case = ("random", decodes + prefills, kv_heads * group, kv_heads, head_dim, block_size, window, splits)
    check_case(case, torch.float32, "cpu", DTYPES[torch.float32])


@interpreted
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("sinks", [False, True])  # a sink adds to a padding row's empty sum: zeros still
def test_padding_rows_give_zeros_and_write_nothing(splits, sinks):
    specs = [(60, 1), (8, 1)]
    b = make_batch(specs, 6, 2, 64, 16, torch.float32, pad_rows=2)
    extra = dict(sinks=torch.linspace(-1, 3, 6), softcap=0.5) if sinks else {}
    ref_out, ref_cache = reference(b, len(specs), 0.125, None, **extra)
    cache = b.kv_cache.clone()
    out = TritonAttentionBackend(num_splits=splits).forward(b.q, b.k, b.v, cache, b.meta(), 0.125, **extra)
    torch.testing.assert_close(out[:2], ref_out, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert torch.equal(cache, ref_cache)  # padding rows wrote nothing


@interpreted
def test_decode_ignores_host_metadata():
    """Decode-only launches read only tensors and shapes (what CUDA-graph replay relies on): stale host
    fields change nothing and no per-step plan is built."""
    b = make_batch([(40, 1), (7, 1)], 4, 2, 64, 16, torch.float32)
    meta = b.meta()
    backend = TritonAttentionBackend()
    expected = backend.forward(b.q, b.k, b.v, b.kv_cache.clone(), meta, 0.125)
    stale = dataclasses.replace(meta, num_decodes=0, seq_lens=[1, 1], max_seqlen_k=1, backend_cache={})
    out = backend.forward(b.q, b.k, b.v, b.kv_cache.clone(), stale, 0.125)
    assert torch.equal(out, expected)
    assert stale.backend_cache == {}


@interpreted
def test_tile_plan_is_built_once_per_step(monkeypatch):
    import cb_serve.attention.triton_backend as tb

    calls = []
    monkeypatch.setattr(tb, "build_tile_plan", lambda *a: calls.append(a) or build_tile_plan(*a))
    b = make_batch([(30, 1), (12, 20)], 2, 1, 32, 16, torch.float32)
    meta, backend = b.meta(), TritonAttentionBackend()
    first = backend.forward(b.q, b.k, b.v, b.kv_cache.clone(), meta, 0.2)
    second = backend.forward(b.q, b.k, b.v, b.kv_cache.clone(), meta, 0.2)  # the next layer
    assert len(calls) == 1 and torch.equal(first, second)


def test_tile_plan_covers_every_query_once():
    q_lens, s_lens = np.array([5, 1, 40, 16]), np.array([5, 9, 100, 16])
    plan = build_tile_plan(q_lens, s_lens, first_seq=2, block_q=16)
    covered = sorted((seq, off + i) for seq, off in plan for i in range(16) if off + i < q_lens[seq - 2])
    assert covered == [(s + 2, i) for s, n in enumerate(q_lens) for i in range(n)]
    kv_end = s_lens[plan[:, 0] - 2] - q_lens[plan[:, 0] - 2] + np.minimum(plan[:, 1] + 16, q_lens[plan[:, 0] - 2])
    assert (np.diff(kv_end) <= 0).all()  # longest tiles first


@interpreted
def test_write_kv_skips_negative_slots():
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(2, 5, 16, 3, 80, generator=gen)
    k, v = torch.randn(2, 7, 3, 80, generator=gen)
    slots = torch.tensor([17, -1, 0, 79, -1, 40, 41])
    expected = kv_cache.clone()
    ok = slots >= 0
    expected[0].view(-1, 3, 80)[slots[ok]] = k[ok]
    expected[1].view(-1, 3, 80)[slots[ok]] = v[ok]
    TritonAttentionBackend.write_kv(k, v, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@interpreted
def test_rejects_unsupported_inputs():
    b = make_batch([(3, 1)], 2, 1, 64, 16, torch.float32)
    backend = TritonAttentionBackend()
    with pytest.raises(ValueError, match="head_dim"):
        q = torch.zeros(1, 2, 512)
        backend.forward(q, q[:, :1], q[:, :1], torch.zeros(2, 2, 16, 1, 512), b.meta(), 1.0)
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        backend.forward(b.q.double(), b.k, b.v, b.kv_cache, b.meta(), 1.0)


CUDA_DTYPES = {
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.float32: dict(atol=2e-4, rtol=2e-4),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", list(CUDA_DTYPES), ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_matches_fp32_reference(case, dtype):
    check_case(case, dtype, "cuda", CUDA_DTYPES[dtype], ref_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", list(CUDA_DTYPES), ids=str)
@pytest.mark.parametrize("softcap,sinks", FEATURES)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_cuda_softcap_and_sinks_match_fp32_reference(case, softcap, sinks, dtype):
    extra = dict(softcap=softcap, sinks=sinks_for(case, "cuda") if sinks else None)
    check_case(case, dtype, "cuda", CUDA_DTYPES[dtype], ref_dtype=torch.float32, **extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_cuda_graph_decode_replays_new_batches(splits):
    """Capture a padded decode step once, then replay it with other lengths, blocks and padding."""
    backend = TritonAttentionBackend(num_splits=splits)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    first = make_batch([(300, 1)] * 6, heads, kv_heads, head_dim, block_size, torch.bfloat16, "cuda", pad_rows=2)
    second = make_batch(
        [(500, 1), (90, 1), (16, 1)], heads, kv_heads, head_dim, block_size, torch.bfloat16, "cuda", pad_rows=5, seed=3
    )
    width = max(first.block_table.shape[1], second.block_table.shape[1])
    num_blocks = max(first.kv_cache.shape[1], second.kv_cache.shape[1])

    def static_inputs(b: Batch) -> tuple[AttentionMetadata, torch.Tensor]:
        b.block_table = np.pad(b.block_table, ((0, 0), (0, width - b.block_table.shape[1])))
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        cache[:, : b.kv_cache.shape[1]] = b.kv_cache
        b.kv_cache = cache
        return b.meta(), cache

    meta, cache = static_inputs(first)
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    backend.forward(q, k, v, cache.clone(), meta, 0.125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, 0.125)
    new_meta, new_cache = static_inputs(second)
    for name in ("seqused_k", "block_table", "slot_mapping", "cu_seqlens_q"):
        getattr(meta, name).copy_(getattr(new_meta, name))
    cache.copy_(new_cache)
    q.copy_(second.q)
    k.copy_(second.k)
    v.copy_(second.v)
    graph.replay()
    ref_out, ref_cache = reference(second, 3, 0.125, None, torch.float32)
    torch.testing.assert_close(out[:3].float(), ref_out, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    torch.testing.assert_close(cache.float()[:, : ref_cache.shape[1]], ref_cache)
