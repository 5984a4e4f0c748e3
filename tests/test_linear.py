"""The CPU linear layer: MKL-packed weights for small batches, transposed storage for large ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cb_serve.model_executor.linear import PACKED_MAX_ROWS, Linear, packed_gemm_works


@pytest.mark.parametrize("bias", [False, True])
def test_prepared_linear_equals_plain_linear_at_every_batch_size(bias):
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias)
    weight = layer.weight.detach().clone()
    bias_value = layer.bias.detach().clone() if bias else None
    layer.prepare_for_cpu(pack=True)
    assert (layer.packed_weight is not None) == packed_gemm_works()
    assert layer.weight.shape == (200, 96) and layer.weight.stride() == (1, 200)  # [out, in], stored transposed
    with torch.inference_mode():
        for rows in (1, 3, 16, 34, 64, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 700):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(layer(x), F.linear(x, weight, bias_value), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 5, 96)  # not 2-D: the plain path
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias_value), rtol=1e-5, atol=1e-5)
        assert layer(torch.randn(0, 96)).shape == (0, 200)


def test_packing_is_float32_only_and_a_tied_weight_keeps_its_layout():
    half = Linear(32, 48).to(torch.bfloat16)
    half.prepare_for_cpu(pack=True)
    assert half.packed_weight is None

    embedding = torch.nn.Embedding(48, 32)
    head = Linear(32, 48, bias=False)
    head.weight = embedding.weight
    head.prepare_for_cpu(pack=True, transpose=False)
    assert head.weight is embedding.weight and embedding.weight.is_contiguous()
    with torch.inference_mode():
        x = torch.randn(5, 32)
        torch.testing.assert_close(head(x), x @ embedding.weight.T, rtol=1e-5, atol=1e-5)
