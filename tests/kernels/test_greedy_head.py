"""The greedy head (``greedy_head.py``): the LM head's argmax from a bf16 first pass and the float32-accurate
logits of the candidate tiles only picks, bit for bit, what the full logits' first maximum picks: ties
(duplicate vocabulary rows) and a vocabulary narrower than the head included."""

from __future__ import annotations

import pytest
import torch
from test_exact_quant import Q4_K, Q5_0, Q8_0, gguf_weight, needs_amx

from cb_serve import cpu_ops
from cb_serve.model_executor.layers.greedy_head import GreedyHead
from cb_serve.model_executor.layers.linear import Linear
from cb_serve.model_executor.sampler import takes_raw_argmax


def amx_head(qtype, out_features: int, hidden: int) -> tuple[Linear, torch.Tensor]:
    """The head (its float32 weight dropped once packed low-bit) and that float32 weight."""
    head = Linear(hidden, out_features, bias=False)
    weight = gguf_weight(out_features, hidden, qtype, seed=out_features)
    lead = int(torch.linalg.vector_norm(weight, dim=1).argmax())  # leads where x points at it
    weight[[lead // 2, lead // 3, 1023]] = weight[lead].clone()  # exact ties: the first index must win
    with torch.no_grad():
        head.weight.copy_(weight)
    head.prepare_for_cpu(pack=True, transpose=False)
    if head.split_kernel != "amx":
        pytest.skip("amx_gemm does not run this head here")
    return head, weight


@needs_amx
@pytest.mark.parametrize("qtype,vocab", [(Q8_0, 1024), (Q8_0, 1000), (Q5_0, 1024)])
def test_greedy_head_picks_the_full_logits_first_maximum(qtype, vocab):
    head, weight = amx_head(qtype, 1024, 256)
    greedy = GreedyHead.for_head(head, vocab)
    gen = torch.Generator().manual_seed(vocab)
    with torch.inference_mode():
        for rows in (head.split_min_rows, 33, 64):
            x = torch.randn(rows, 256, generator=gen) * torch.logspace(-1, 1, rows)[:, None]
            x[0, :8] *= 100  # an outlier row, as Gemma's hidden states have
            x[1] = weight[-1] * 50  # the longest row and its copies lead
            expected = head(x)[:, :vocab].max(dim=-1).indices
            assert torch.equal(greedy(x), expected)
            assert expected[1] == torch.linalg.vector_norm(weight, dim=1).argmax()  # the first copy


@needs_amx
def test_greedy_head_declines_what_it_cannot_reproduce():
    head, weight = amx_head(Q8_0, 1024, 256)
    greedy = GreedyHead.for_head(head, 1024)
    with torch.inference_mode():
        assert greedy(torch.randn(head.split_min_rows - 1, 256)) is None  # the full path runs decode_gemm
        x = torch.randn(20, 256)
        x[3, 7] = float("inf")
        assert greedy(x) is None
    plain = Linear(256, 1024, bias=False)
    plain.prepare_for_cpu(pack=True)
    assert GreedyHead.for_head(plain, 1024) is None  # a float weight: no split kernel
    assert GreedyHead.for_head(amx_head(Q4_K, 1024, 256)[0], 1024) is None  # 4 bits: its first pass is 8-bit only


@needs_amx
def test_pair_maxima_are_the_bf16_products_maxima():
    head, weight = amx_head(Q8_0, 1024, 256)
    x = torch.randn(20, 256)
    with torch.inference_mode():
        pair_max = cpu_ops.amx_pair_max(x, head.split_weight, 1000)
    approx = x.bfloat16().double() @ weight.bfloat16().double()[:1000].T
    expected = torch.nn.functional.pad(approx, (0, 24), value=float("-inf")).view(20, -1, 32).amax(dim=2)
    torch.testing.assert_close(pair_max.double(), expected, rtol=1e-5, atol=1e-5)


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
