"""The CPU linear layer: a packed weight for ``cpu_ops.decode_gemm`` at decode batch sizes,
MKL on the transposed weight above them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cb_serve import cpu_ops
from cb_serve.model_executor.layers.linear import DECODE_MAX_ROWS, Linear

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernels did not build")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(96, 200), (576, 960), (40, 17)])  # (in, out); 17 and 200 pad a tile
def test_prepared_linear_equals_plain_linear_at_every_batch_size(bias, shape):
    torch.manual_seed(0)
    layer = Linear(*shape, bias=bias)
    weight = layer.weight.detach().clone()
    bias_value = layer.bias.detach().clone() if bias else None
    layer.prepare_for_cpu(pack=True)
    assert layer.decode_weight is not None
    assert layer.weight.shape == shape[::-1] and layer.weight.stride() == (1, shape[1])  # [out, in], stored transposed
    with torch.inference_mode():
        for rows in (1, 3, 12, 13, 34, DECODE_MAX_ROWS, DECODE_MAX_ROWS + 1, 300):
            x = torch.randn(rows, shape[0])
            torch.testing.assert_close(layer(x), F.linear(x, weight, bias_value), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 5, shape[0])  # not 2-D: the plain path
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias_value), rtol=1e-5, atol=1e-5)
        assert layer(torch.randn(0, shape[0])).shape == (0, shape[1])


def test_decode_gemm_rows_do_not_depend_on_the_batch():
    """Each output is one FMA chain over k: a row's result is bit-identical alone or in a batch."""
    torch.manual_seed(1)
    weight = torch.randn(100, 64)
    packed = cpu_ops.pack_decode_weight(weight)
    x = torch.randn(30, 64)
    batch = cpu_ops.decode_gemm(x, packed, 100, None)
    for row in (0, 11, 12, 29):
        assert torch.equal(cpu_ops.decode_gemm(x[row : row + 1].contiguous(), packed, 100, None)[0], batch[row])


def test_packing_is_float32_only_and_a_tied_weight_keeps_its_layout():
    half = Linear(32, 48).to(torch.bfloat16)
    half.prepare_for_cpu(pack=True)
    assert half.decode_weight is None

    embedding = torch.nn.Embedding(48, 32)
    head = Linear(32, 48, bias=False)
    head.weight = embedding.weight
    head.prepare_for_cpu(pack=True, transpose=False)
    assert head.weight is embedding.weight and embedding.weight.is_contiguous()
    with torch.inference_mode():
        x = torch.randn(5, 32)
        torch.testing.assert_close(head(x), x @ embedding.weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(96, 200), (40, 17)])  # (in, out): 40 inputs keep AMX out (32 per group)
def test_a_bf16_checkpoint_weight_is_read_as_bf16(shape):
    """A weight exact in bf16 (a bf16 checkpoint loaded in float32) is packed at 2 bytes a weight: decode
    batches give decode_gemm's bits on the float32 copy, every batch F.linear's values to float32 rounding."""
    torch.manual_seed(2)
    weight, bias = torch.randn(shape[::-1]).bfloat16().float(), torch.randn(shape[1])
    layers = [Linear(*shape), Linear(*shape)]
    for layer, w in zip(layers, (weight, weight + 2.0**-20)):  # the second: not exact in bf16
        layer.weight.data.copy_(w)
        layer.bias.data.copy_(bias)
        layer.prepare_for_cpu(pack=True)
    bf16, fp32 = layers
    assert bf16.bf16_weight.dtype == torch.bfloat16 and fp32.bf16_weight is None
    assert bf16.bytes_read(1) < fp32.bytes_read(1) / 1.9
    fp32.decode_weight = cpu_ops.pack_decode_weight(weight)  # the float32 packing of the same values
    with torch.inference_mode():
        for rows in (1, 12, 31, DECODE_MAX_ROWS, 300):
            x = torch.randn(rows, shape[0])
            torch.testing.assert_close(bf16(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
            if rows < 32:
                assert torch.equal(bf16(x), fp32(x))
