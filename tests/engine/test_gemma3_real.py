"""The real Gemma 3 270M (Q4_K_M GGUF, the second built-in model, ``model="gemma-3-270m"``):
greedy tokens equal HF transformers loading the same GGUF (dequantized to float32), through the
exactness harness under chunked prefill, preemption and prefix hits; a chat request to this base
model is refused, naming why."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
from exactness import check_engine_exercised, make_prompts, run_and_compare
from models import STRESS_ENGINE_ARGS

from cb_serve import LLM
from cb_serve.errors import InvalidRequestError
from cb_serve.model_executor.builtin_models import GEMMA3_INSTALL, GEMMA3_PACKAGE

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(GEMMA3_PACKAGE) is None, reason=f"gemma-3-270m not installed (`{GEMMA3_INSTALL}`)"
)


@pytest.fixture(scope="module")
def gemma():
    # Its KV cache by layer type has 6 groups of 3 layers (a block is 3 layers' pages, not 18): six
    # times the blocks are the stress settings' memory, and every group keeps a 400-token sequence whole.
    return LLM("gemma-3-270m", **{**STRESS_ENGINE_ARGS, "num_gpu_blocks": 6 * STRESS_ENGINE_ARGS["num_gpu_blocks"]})


@pytest.fixture(scope="module")
def gemma_hf(gemma):
    from hf_oracle import hf_model_from_gguf

    return hf_model_from_gguf(gemma.engine.source)


def test_gemma3_270m_matches_hf(gemma, gemma_hf):
    assert gemma.engine.source.name == "gemma-3-270m"
    text = pathlib.Path(__file__).read_text() * 8
    prompts, max_tokens = make_prompts(gemma.get_tokenizer().encode(text), seed=3)
    deltas = run_and_compare(gemma, gemma_hf, prompts, max_tokens, "gemma-3-270m", stop_at_eos=True)
    check_engine_exercised(gemma, prompts, deltas)
    assert gemma.engine.get_stats().kv_blocks_used == 0


def test_a_chat_request_to_the_base_model_is_refused(gemma):
    with pytest.raises(InvalidRequestError, match="no chat template.*completions"):
        gemma.chat([{"role": "user", "content": "Hello"}])


def test_the_greedy_head_picks_what_the_logits_pick(gemma):
    """Plain greedy batches of 13+ rows on AMX take the LM head's two-pass argmax (``greedy_head.py``);
    asking for logprobs takes the full logits and the sampler: the same tokens, bit for bit."""
    import torch

    from cb_serve import SamplingParams

    llm = LLM("gemma-3-270m", max_num_seqs=32, max_model_len=256, num_gpu_blocks=600)
    with torch.inference_mode():
        applies = llm.engine.runner.model.greedy_token_ids(torch.zeros(16, 640)) is not None
    if not applies:
        pytest.skip("the LM head does not run amx_gemm here (no AMX)")
    tokens = gemma.get_tokenizer().encode(pathlib.Path(__file__).read_text())
    prompts = [{"prompt_token_ids": tokens[i * 7 : i * 7 + 20 + i]} for i in range(24)]
    runs = [
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=k), use_tqdm=False)
        for k in (None, 0)
    ]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
