"""The greedy head (``greedy_head.py``): the LM head's argmax from a first pass (AMX's bf16 tiles or
AVX512-VNNI's int8) and the float32-accurate logits of the candidate tiles only picks, bit for bit, what the
full logits' first maximum picks: ties (duplicate vocabulary rows) and a vocabulary narrower than the head
included."""

from __future__ import annotations

import pytest
import torch
from test_exact_quant import Q4_K, Q5_0, Q6_K, Q8_0, gguf_weight, needs_amx

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant
from cb_serve.model_executor.layers.greedy_head import AmxGreedyHead, GreedyHead, Int8GreedyHead
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.sampler import takes_raw_argmax

needs_a_first_pass = pytest.mark.skipif(
    not (cpu_ops.amx_available() or cpu_ops.int8_tile_max_available()),
    reason="neither AMX nor AVX512-VNNI here: the head always runs the full path",
)


def low_bit_head(qtype, out_features: int, hidden: int) -> tuple[Linear, torch.Tensor]:
    """The head (its float32 weight dropped once packed low-bit) and that float32 weight."""
    head = Linear(hidden, out_features, bias=False)
    weight = gguf_weight(out_features, hidden, qtype, seed=out_features)
    lead = int(torch.linalg.vector_norm(weight, dim=1).argmax())  # leads where x points at it
    weight[[lead // 2, lead // 3, 1023]] = weight[lead].clone()  # exact ties: the first index must win
    with torch.no_grad():
        head.weight.copy_(weight)
    head.prepare_for_cpu(pack=True, transpose=False)
    return head, weight


@needs_a_first_pass
@pytest.mark.parametrize("qtype,vocab", [(Q8_0, 1024), (Q8_0, 1000), (Q5_0, 1024), (Q8_0, 1000 - 32)])
def test_greedy_head_picks_the_full_logits_first_maximum(qtype, vocab):
    """The first pass of this CPU (AMX's bf16 tiles or AVX512-VNNI's int8), the pick of the full logits."""
    head, weight = low_bit_head(qtype, 1024, 256)
    greedy = GreedyHead.for_head(head, vocab)
    assert isinstance(greedy, AmxGreedyHead if cpu_ops.amx_available() else Int8GreedyHead)
    gen = torch.Generator().manual_seed(vocab)
    with torch.inference_mode():
        for rows in (greedy.min_rows, 13, 33, 64, 300):
            x = torch.randn(rows, 256, generator=gen) * torch.logspace(-1, 1, rows)[:, None]
            x[0, :8] *= 100  # an outlier row, as Gemma's hidden states have
            x[1] = weight[-1] * 50  # the longest row and its copies lead
            x[2, 32:64] = 0  # a group of zeros (its scale is 0)
            expected = head(x)[:, :vocab].max(dim=-1).indices
            assert torch.equal(greedy(x), expected)
            assert expected[1] == torch.linalg.vector_norm(weight, dim=1).argmax()  # the first copy


@needs_a_first_pass
def test_greedy_head_declines_what_it_cannot_reproduce():
    head, _ = low_bit_head(Q8_0, 1024, 256)
    greedy = GreedyHead.for_head(head, 1024)
    with torch.inference_mode():
        assert greedy(torch.randn(greedy.min_rows - 1, 256)) is None  # too few rows: the full path
        x = torch.randn(20, 256)
        x[3, 7] = float("inf")
        assert greedy(x) is None
    plain = Linear(256, 1024, bias=False)
    plain.prepare_for_cpu(pack=True)
    assert GreedyHead.for_head(plain, 1024) is None  # a float weight
    assert GreedyHead.for_head(low_bit_head(Q4_K, 1024, 256)[0], 1024) is None  # 4 bits: the first pass is 8-bit
    assert GreedyHead.for_head(low_bit_head(Q6_K, 1024, 256)[0], 1024) is None  # scales per 16 inputs


@needs_amx
def test_pair_maxima_are_the_bf16_products_maxima():
    head, weight = low_bit_head(Q8_0, 1024, 256)
    x = torch.randn(20, 256)
    with torch.inference_mode():
        pair_max = cpu_ops.amx_pair_max(x, head.split_weight, 1000)
    approx = x.bfloat16().double() @ weight.bfloat16().double()[:1000].T
    expected = torch.nn.functional.pad(approx, (0, 24), value=float("-inf")).view(20, -1, 32).amax(dim=2)
    torch.testing.assert_close(pair_max.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.int8_tile_max_available(), reason="no AVX512-VNNI here")
def test_int8_tile_maxima_are_the_integer_products_maxima():
    """Per row and tile: the largest ``sum_g d s (xq . q)``, columns past the vocabulary left out (a tile
    wholly past it is -inf), every column position of the kernel's interleaving included."""
    head, weight = low_bit_head(Q8_0, 1024, 256)
    groups = exact_quant.find_quant_groups(weight)
    gen = torch.Generator().manual_seed(5)
    xq = torch.randint(-127, 128, (23, 8, 32), generator=gen)  # two blocks of rows and a tail
    scale = torch.rand(23, 8, generator=gen) / 100
    out = cpu_ops.int8_tile_max((xq + 128).to(torch.uint8).view(torch.int32), scale, head.decode_weight, 1000 - 32)
    dots = torch.einsum("mgk,ngk->mng", xq.double(), groups.q.view(1024, 8, 32).double())  # exact integers
    approx = (dots * groups.d.double()[None] * scale.double()[:, None]).sum(-1)[:, : 1000 - 32]
    expected = torch.nn.functional.pad(approx, (0, 56), value=float("-inf")).view(23, -1, 32).amax(dim=2)
    assert out.shape == (23, 32) and torch.isinf(out[:, -1]).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


class _Params:
    def __init__(self, greedy: bool, logprobs: int | None) -> None:
        self.greedy, self.logprobs = greedy, logprobs
        self.has_logits_processors = False


class _Seq:
    def __init__(self, greedy: bool = True, logprobs: int | None = None, banned: list[int] | None = None) -> None:
        self.params, self.banned = _Params(greedy, logprobs), banned or []

    def banned_token_ids(self) -> list[int]:
        return self.banned


def test_only_plain_greedy_rows_take_the_raw_argmax():
    assert takes_raw_argmax([_Seq(), _Seq()])
    assert not takes_raw_argmax([_Seq(), _Seq(greedy=False)])
    assert not takes_raw_argmax([_Seq(logprobs=0)])
    assert not takes_raw_argmax([_Seq(banned=[2])])
