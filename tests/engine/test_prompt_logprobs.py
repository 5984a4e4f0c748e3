"""``prompt_logprobs`` against HF transformers' forward pass: each prompt token's log-softmax
(its own logprob, its rank, the top-k) equals HF's float32 log-softmax to 1e-4, whether the
prompt runs in one step or in chunks, and whether its prefix is in the prefix cache (the cache is
not read for such a request: its prompt is recomputed)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cb_serve import LLM, SamplingParams

ATOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def model_dir(random_model_dir):
    return random_model_dir("llama")


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return run


@pytest.fixture(scope="module")
def chunked_llm(model_dir):
    """Chunked prefill of 16 tokens a step, and a prefix cache of 4-token blocks."""
    return LLM(str(model_dir), max_model_len=256, num_gpu_blocks=128, block_size=4, max_num_batched_tokens=16)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (length,), generator=g).tolist() for _ in range(n)]


def check(entries, token_ids: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(token_ids) and entries[0] is None
    for pos, (token, entry) in enumerate(zip(token_ids[1:], entries[1:]), start=1):
        row = reference[pos - 1]
        own = entry[token]
        assert abs(own.logprob - row[token].item()) < ATOL
        # The rank: 1 + the tokens above it, up to the ones within the tolerance (near ties).
        assert int((row > own.logprob + ATOL).sum()) + 1 <= own.rank <= int((row > own.logprob - ATOL).sum()) + 1
        ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank <= k)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        assert torch.allclose(torch.tensor([lp for _, lp in ranked]), row.topk(k).values, atol=ATOL)
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < ATOL and lp.decoded_token is not None


@pytest.mark.parametrize("engine", ["whole", "chunked"])
def test_prompt_logprobs_equal_hf(engine, tiny_llm, chunked_llm, hf_logprobs):
    llm = tiny_llm if engine == "whole" else chunked_llm
    batch = prompts(3, 37, seed=1)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)
    for out, token_ids in zip(llm.generate([{"prompt_token_ids": p} for p in batch], params), batch):
        check(out.prompt_logprobs, token_ids, hf_logprobs(token_ids), K)


def test_prefix_hits_do_not_change_prompt_logprobs(chunked_llm, hf_logprobs):
    """The second request shares the first's 32-token prefix (8 cached blocks): it still gets every
    prompt token's logprob, equal to HF's; a request without prompt logprobs does hit the cache."""
    first, rest = prompts(2, 32, seed=2)
    shared = first + rest[:9]
    llm = chunked_llm
    llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=1))
    cached = llm.generate([{"prompt_token_ids": shared}], SamplingParams(max_tokens=1))[0]
    assert cached.num_cached_tokens >= 28
    out = llm.generate([{"prompt_token_ids": shared}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    check(out.prompt_logprobs, shared, hf_logprobs(shared), 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # k = 0: the prompt token alone


def test_prompt_logprobs_with_n_and_streaming_deltas(tiny_llm, hf_logprobs):
    """``n > 1``: computed once; DELTA outputs carry them in the first output only."""
    from cb_serve import RequestOutputKind

    token_ids = prompts(1, 20, seed=3)[0]
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=0, prompt_logprobs=1)
    out = tiny_llm.generate([{"prompt_token_ids": token_ids}], params)[0]
    check(out.prompt_logprobs, token_ids, hf_logprobs(token_ids), 1)
    engine = tiny_llm.engine
    delta = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta", {"prompt_token_ids": token_ids}, delta)
    carried = []
    while engine.has_unfinished_requests():
        carried += [o.prompt_logprobs is not None for o in engine.step() if o.request_id == "delta"]
    assert carried[0] and not any(carried[1:])


def test_one_token_prompt(tiny_llm):
    out = tiny_llm.generate([{"prompt_token_ids": [7]}], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None]
