"""The fused Triton layer kernels (``layers/fused_triton.py``) against the PyTorch layers they replace:
``RMSNorm`` / ``GemmaRMSNorm`` with and without a residual (2-D hidden states, 3-D q/k heads, strided views)
and the gated activations. Without CUDA they run in the Triton interpreter (conftest sets
``TRITON_INTERPRET=1``), so shapes stay small. Float32 is held to a few units in the last place; bfloat16
to one unit where the float32 statistics land on a rounding boundary (the sums' order differs)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the fused layer kernels need the triton package")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not set before triton was imported", allow_module_level=True)

from cb_serve.model_executor.layers import fused_triton  # noqa: E402
from cb_serve.model_executor.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
EPS = 1e-6


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        return
    diff = (ours.float() - ref.float()).abs()
    ulp = ref.float().abs().clamp(min=1e-2) * 2.0**-7  # one bfloat16 unit in the last place
    assert (diff <= ulp).all(), diff.max()
    assert (diff > 0).float().mean() < 0.02, "more than the rare rounding-boundary row differs"


def norm_layer(gemma: bool, width: int, dtype: torch.dtype) -> RMSNorm:
    layer = (GemmaRMSNorm if gemma else RMSNorm)(width, EPS).to(DEVICE)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(width) * 0.3 + (0.0 if gemma else 1.0))
    return layer.to(dtype) if not gemma else layer  # Gemma keeps a float32 weight, as HF's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("width", [64, 96])
def test_rms_norm_with_and_without_a_residual(dtype, gemma, width):
    torch.manual_seed(width)
    layer = norm_layer(gemma, width, dtype)
    x = (torch.randn(7, width) * 3).to(DEVICE, dtype)
    residual = torch.randn(7, width).to(DEVICE, dtype)
    close(fused_triton.rms_norm(x, layer.weight, EPS, gemma), layer._norm(x))
    ref_norm, ref_residual = layer._norm(residual + x), residual + x
    ours_norm, ours_residual = fused_triton.fused_add_rms_norm(x, residual.clone(), layer.weight, EPS, gemma)
    assert torch.equal(ours_residual, ref_residual)  # the sum, rounded to the dtype as PyTorch rounds it
    close(ours_norm, ref_norm)


def test_q_k_heads_and_strided_views():
    torch.manual_seed(0)
    layer = norm_layer(False, 16, torch.float32)
    qkv = torch.randn(5, 3 * 4 * 16, device=DEVICE)
    q = qkv[:, : 4 * 16].view(5, 4, 16)  # rows of a strided view: heads of head_dim
    close(fused_triton.rms_norm(q, layer.weight, EPS), layer._norm(q))
    assert fused_triton.rms_norm(q[:0], layer.weight, EPS).shape == (0, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul(dtype, activation):
    torch.manual_seed(1)
    x = (torch.randn(6, 2 * 80) * 2).to(DEVICE, dtype)
    gate, up = x.split(80, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    close(fused_triton.act_and_mul(x, activation), act * up)
    assert fused_triton.act_and_mul(x[:0], activation).shape == (0, 80)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the layers' CPU tensors interpreted")
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_models_with_the_fused_layers_give_hfs_greedy_tokens(random_model_dir, tokenizer, monkeypatch, arch, backend):
    """The decoder layers take the fused kernels (as on CUDA) for the norms (with the residual's add where it comes
    before the norm: Llama's pre-norm layers), the q/k norms and the MLP's activation: HF's greedy tokens in
    float32 (Llama's and Gemma's norms, SiLU and GELU-tanh); with the triton backend, RoPE with the KV write too."""
    from models import assert_greedy_match, hf_greedy

    from cb_serve import LLM, SamplingParams
    from cb_serve.attention import triton_rope_kv

    model = str(random_model_dir(arch))
    prompts = [tokenizer.encode(t) for t in ("One two three", "a b c d e f g h i j k")]
    expected = hf_greedy(model, prompts, [6, 6])
    calls = []
    wrapped = [(fused_triton, n) for n in ("rms_norm", "fused_add_rms_norm", "act_and_mul")]
    for module, name in [*wrapped, (triton_rope_kv, "rope_and_write_kv")]:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(*a, **k))[1])
    monkeypatch.setattr(fused_triton, "INTERPRETED_ON_CPU", True)
    llm = LLM(model, max_model_len=64, num_gpu_blocks=16, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    fused = {"rms_norm", "act_and_mul"} | ({"fused_add_rms_norm"} if arch == "llama" else set())  # Gemma: sandwich
    fused |= {"rope_and_write_kv"} if backend == "triton" else set()
    assert fused <= set(calls), set(calls)
    for i, (ours, (ref, logits)) in enumerate(zip(outputs, expected)):
        assert_greedy_match(ours, ref, logits, context=f"{arch} request {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_shapes_of_real_models(dtype):
    """Hidden sizes of SmolLM2, Llama 3.2 1B and Gemma 3 270M on the GPU (compiled, not interpreted)."""
    for width, inter in ((576, 1536), (2048, 8192), (640, 2048)):
        for gemma in (False, True):
            layer = norm_layer(gemma, width, dtype).cuda()
            x, residual = (torch.randn(33, width) * 3).cuda().to(dtype), torch.randn(33, width).cuda().to(dtype)
            ours, ours_residual = fused_triton.fused_add_rms_norm(x, residual.clone(), layer.weight, EPS, gemma)
            assert torch.equal(ours_residual, residual + x)
            close(ours, layer._norm(residual + x))
        x = torch.randn(33, 2 * inter).cuda().to(dtype)
        gate, up = x.split(inter, dim=-1)
        close(fused_triton.act_and_mul(x, "silu"), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full", "partial"])
def test_rope_with_the_kv_write(dtype, rotary_dim):
    """The triton backend's fused RoPE + KV write against the PyTorch RoPE and its KV-write kernel: the same q,
    the same cache (k rotated, v as is, padding slot -1 untouched), from strided views of a fused projection."""
    check_rope(dtype, rotary_dim, heads=4, kv_heads=2, head_dim=16, device=DEVICE)


def check_rope(dtype, rotary_dim: int, heads: int, kv_heads: int, head_dim: int, device: str) -> None:
    from cb_serve.attention.triton_backend import TritonAttentionBackend
    from cb_serve.model_executor.layers.rotary import Rope

    torch.manual_seed(2)
    tokens, block_size = 5, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(device, dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    q, k = qk.split([heads, kv_heads], dim=1)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    angles = torch.arange(64.0)[:, None] * torch.rand(rotary_dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    positions = torch.tensor([3, 9, 0, 41, 7])
    rope = Rope(positions.to(device), cos.to(device), sin.to(device), dtype, use_cpu_ops=False)
    slots = torch.tensor([17, 2, -1, 40, 5], device=device)
    backend = TritonAttentionBackend()
    cache = torch.zeros(2, 4, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    ours_q = backend.rope_and_write_kv(q, k, v, rope.cos[:, 0], rope.sin[:, 0], cache, slots)
    ref_q, ref_k = rope.apply(qk.clone()).split([heads, kv_heads], dim=1)
    ref_cache = torch.zeros_like(cache)
    backend.write_kv(ref_k, v, ref_cache, slots)
    if dtype == torch.float32 and device == "cuda":  # the GPU may contract a product and the sum into one FMA
        torch.testing.assert_close(ours_q, ref_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-6, atol=1e-6)
        return
    assert torch.equal(ours_q, ref_q) and torch.equal(cache, ref_cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rope_with_the_kv_write(dtype):
    """SmolLM2's, Llama 3.2 1B's and Gemma 3 270M's heads (64, 64 and 256 dims), and a partial rotary."""
    for heads, kv_heads, head_dim, rotary_dim in ((9, 3, 64, 64), (32, 8, 64, 64), (4, 1, 256, 256), (8, 2, 96, 32)):
        check_rope(dtype, rotary_dim, heads, kv_heads, head_dim, device="cuda")
