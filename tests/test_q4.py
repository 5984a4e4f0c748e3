"""4-bit packing of exactly-4-bit-affine float32 weights (dequantized GGUF Q4_1): recognized from the
float32 values alone, and the decode GEMM on the 4-bit copy is bit for bit the float32 one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from cb_serve import cpu_ops
from cb_serve.cpu_ops import q4
from cb_serve.model_executor.linear import Linear

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernels did not build")


def gguf_weight(n: int, k: int, qtype: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """A random weight quantized and dequantized by gguf-py, as transformers loads a GGUF file."""
    w = np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32)
    return torch.from_numpy(quants.dequantize(quants.quantize(w, qtype), qtype).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("shape", [(17, 64), (200, 96), (960, 576), (64, 1536)])  # (out, in)
def test_q4_1_weights_are_recognized_exactly(shape):
    weight = gguf_weight(*shape, GGMLQuantizationType.Q4_1)
    groups = q4.find_q4_groups(weight)
    assert groups is not None
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15
    assert torch.equal(groups.dequantize(), weight)
    assert torch.equal(groups.d, groups.d.half().float())  # float16 scales: d * q is exact


def test_row_permutations_and_constant_groups_are_still_4_bit():
    weight = gguf_weight(96, 64, GGMLQuantizationType.Q4_1)
    weight[3, :32] = 0.25  # a constant group
    weight[5, 32:] = 0.0
    permuted = weight.view(3, 16, 2, 64).transpose(1, 2).reshape(96, 64)  # like the Llama Q/K permutation
    for w in (weight, permuted):
        groups = q4.find_q4_groups(w)
        assert groups is not None and torch.equal(groups.dequantize(), w)


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(64, 64),  # plain float32
        gguf_weight(64, 64, GGMLQuantizationType.Q8_0),  # 8-bit: more than 16 levels per group
        gguf_weight(64, 64, GGMLQuantizationType.Q4_1)[:, :40],  # K % 32 != 0
        gguf_weight(64, 64, GGMLQuantizationType.Q4_1).double(),
    ],
    ids=["float32", "q8_0", "k-not-multiple-of-32", "float64"],
)
def test_other_weights_are_not_4_bit(weight):
    assert q4.find_q4_groups(weight) is None


def test_one_off_value_rejects_the_whole_weight():
    weight = gguf_weight(128, 64, GGMLQuantizationType.Q4_1)
    weight[100, 7] = torch.nextafter(weight[100, 7], torch.tensor(1.0))
    assert q4.find_q4_groups(weight) is None


@needs_kernels
@pytest.mark.parametrize("shape", [(17, 64), (200, 96), (960, 576), (576, 1536)])
def test_decode_gemm_on_4_bits_is_bit_identical_to_float32(shape):
    n, k = shape
    weight = gguf_weight(n, k, GGMLQuantizationType.Q4_1, seed=n)
    packed = q4.pack_decode_weight_q4(q4.find_q4_groups(weight))
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 32), k // 32, 768)  # 0.75 bytes per weight
    reference = cpu_ops.pack_decode_weight(weight)
    bias = torch.randn(n)
    for rows in (1, 5, 12, 13, 34, 64):
        x = torch.randn(rows, k)
        for b in (None, bias):
            assert torch.equal(cpu_ops.decode_gemm(x, packed, n, b), cpu_ops.decode_gemm(x, reference, n, b))


@needs_kernels
def test_linear_keeps_4_bits_for_a_q4_weight_and_float32_otherwise():
    q4_layer, fp32_layer = Linear(576, 200, bias=True), Linear(576, 200, bias=True)
    with torch.no_grad():
        q4_layer.weight.copy_(gguf_weight(200, 576, GGMLQuantizationType.Q4_1))
        fp32_layer.weight.copy_(q4_layer.weight)
        fp32_layer.bias.copy_(q4_layer.bias)
    weight, bias = q4_layer.weight.detach().clone(), q4_layer.bias.detach().clone()
    q4_layer.prepare_for_cpu(pack=True)
    assert q4_layer.decode_weight.dtype == torch.uint8
    fp32_layer.decode_weight = cpu_ops.pack_decode_weight(fp32_layer.weight)
    with torch.inference_mode():
        for rows in (1, 34, 300):  # 300: prefill rows take the MKL path on the float32 weight
            x = torch.randn(rows, 576)
            torch.testing.assert_close(q4_layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
            if rows <= 64:
                assert torch.equal(q4_layer(x), fp32_layer(x))

    plain = Linear(64, 32)
    plain.prepare_for_cpu(pack=True)
    assert plain.decode_weight.dtype == torch.float32


@needs_kernels
def test_the_default_model_decodes_from_4_bit_weights(smol_llm):
    """SmolLM2's GGUF is Q4_1 in every projection (Q8_0 in the tied embedding / LM head)."""
    model = smol_llm.engine.runner.model
    projections = [
        linear
        for layer in model.layers
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    assert len(projections) == 120
    assert all(linear.decode_weight.dtype == torch.uint8 for linear in projections)
    assert model.lm_head.decode_weight.dtype == torch.float32
