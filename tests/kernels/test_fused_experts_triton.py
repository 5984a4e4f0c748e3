"""The Triton grouped expert GEMM against the PyTorch reference (``TorchExpertGemm``) on expert-sorted
rows: empty experts, odd K/N, row counts off the block size, with and without bias. Without CUDA the
kernel runs in the Triton interpreter (conftest sets ``TRITON_INTERPRET=1``), so shapes stay small."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the triton expert GEMM needs the triton package")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set before triton was imported", allow_module_level=True)

from cb_serve.model_executor.layers.fused_experts import TorchExpertGemm  # noqa: E402
from cb_serve.model_executor.layers.fused_experts_triton import TritonExpertGemm, block_table  # noqa: E402
from cb_serve.model_executor.layers.moe import expert_gemm  # noqa: E402

# As in test_triton_attention.py: CPU tensors need the interpreter, which a CUDA host has off unless
# TRITON_INTERPRET=1 was set before triton was imported; there the CUDA tests below cover the kernel.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
)

# (id, rows per expert, K, N, bias, weight stored [E, K, N] and read transposed)
CASES = [
    ("odd-kn-empty-expert", [5, 0, 37, 1], 40, 72, True, False),
    ("no-bias-empty-ends", [0, 20, 3, 0, 17], 64, 32, False, False),
    ("block64-partial", [70, 66], 24, 100, True, False),
    ("decode-k8", [1, 1, 0, 1], 8, 40, True, False),
    ("strided-weight", [9, 30, 2], 33, 20, False, True),
    ("no-rows", [0, 0, 0], 16, 24, True, False),
]


def make_case(counts, k, n, has_bias, transposed, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    e = len(counts)
    x = torch.randn(sum(counts), k, generator=gen)
    w = torch.randn(e, k, n, generator=gen).transpose(1, 2) if transposed else torch.randn(e, n, k, generator=gen)
    bias = torch.randn(e, n, generator=gen) if has_bias else None
    offsets = torch.cumsum(torch.tensor([0, *counts]), 0)

    def to(t):
        return None if t is None else t.to(device=device, dtype=dtype)

    return to(x), offsets.to(device), to(w), n, to(bias)


@interpreted
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_reference(case):
    args = make_case(*case[1:])
    out = TritonExpertGemm()(*args)
    ref = TorchExpertGemm()(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.parametrize("case", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_float16_matches_fp32_reference(case):
    """float16 only: the interpreter's ``tl.dot`` multiplies bfloat16 bit patterns (triton-lang/triton#11584),
    so bfloat16 is checked on CUDA alone."""
    x, offsets, w, n, bias = make_case(*case[1:], dtype=torch.float16)
    out = TritonExpertGemm()(x, offsets, w, n, bias)
    ref = TorchExpertGemm()(x.float(), offsets, w.float(), n, None if bias is None else bias.float())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=5e-3)


@pytest.mark.parametrize("block_m", [16, 64])
def test_block_table_covers_every_row_once(block_m):
    counts = [0, 5, 16, 17, 0, 64, 1, 0]
    offsets = torch.cumsum(torch.tensor([0, *counts]), 0)
    num_rows = sum(counts)
    expert, start = block_table(offsets, block_m, num_rows)
    assert expert.numel() == num_rows // block_m + min(len(counts), num_rows)
    covered = []
    for e, s in zip(expert.tolist(), start.tolist()):
        if e >= 0:
            end = min(s + block_m, int(offsets[e + 1]))
            assert offsets[e] <= s < end  # within one expert, never empty
            covered += range(s, end)
    assert covered == list(range(num_rows))
    used = expert >= 0
    assert not used[used.sum() :].any()  # unused entries last


def test_selected_for_cuda_only():
    assert isinstance(expert_gemm(torch.device("cuda"), torch.bfloat16, use_cpu_ops=False), TritonExpertGemm)
    assert isinstance(expert_gemm(torch.device("cuda"), torch.float64, use_cpu_ops=False), TorchExpertGemm)
    assert isinstance(expert_gemm(torch.device("cpu"), torch.float32, use_cpu_ops=False), TorchExpertGemm)


def test_rejects_mixed_dtypes():
    x, offsets, w, n, bias = make_case([2, 3], 16, 16, True, False)
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        TritonExpertGemm()(x.double(), offsets, w, n, bias)
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        TritonExpertGemm()(x, offsets, w.half(), n, bias)


CUDA_DTYPES = {
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.float32: dict(atol=2e-4, rtol=2e-4),
}
CUDA_CASES = [*CASES, ("large", [300, 0, 7, 129, 64, 1, 0, 500], 256, 520, True, False)]


def check_cuda(case, dtype, *, seed=0):
    args = make_case(*case[1:], dtype=dtype, device="cuda", seed=seed)
    x, offsets, w, n, bias = args
    ref = TorchExpertGemm()(x.float(), offsets, w.float(), n, None if bias is None else bias.float())
    out = TritonExpertGemm()(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **CUDA_DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", list(CUDA_DTYPES), ids=str)
@pytest.mark.parametrize("case", CUDA_CASES, ids=[c[0] for c in CUDA_CASES])
def test_cuda_matches_fp32_reference(case, dtype):
    check_cuda(case, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_new_routing():
    """The launch reads ``offsets`` only on the device: captured once, replayed with other row counts."""
    x, offsets, w, n, bias = make_case([40, 0, 3, 21], 64, 96, True, False, torch.bfloat16, "cuda")
    gemm = TritonExpertGemm()
    gemm(x, offsets, w, n, bias)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm(x, offsets, w, n, bias)
    offsets.copy_(torch.cumsum(torch.tensor([0, 0, 33, 30, 1]), 0))
    graph.replay()
    ref = TorchExpertGemm()(x.float(), offsets, w.float(), n, bias.float())
    torch.testing.assert_close(out.float(), ref, **CUDA_DTYPES[torch.bfloat16])
