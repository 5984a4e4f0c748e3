"""The FP8 KV cache (``kv_cache_dtype="fp8"``, vLLM's name; e4m3, scales from the checkpoint or 1.0) in the
engine: a quarter of float32's bytes per block (so four times the blocks in the same memory, twice bf16's),
under the stress workload (chunked prefill, preemption, prefix-cache hits) the C++ backend gives the
PyTorch reference's tokens over the same cache and returns every block, and what it cannot serve is refused
by name. (Agreement with a bf16 cache on the real models: ``bench/kv_cache_fp8.py``.)"""

from __future__ import annotations

import pytest
import torch
from exactness import check_engine_exercised, make_prompts
from models import STRESS_ENGINE_ARGS
from observe import counter_deltas

from cb_serve import LLM, SamplingParams, cpu_ops
from cb_serve.model_executor.model_setup import kv_cache_torch_dtype

FP8 = torch.float8_e4m3fn


def test_an_fp8_cache_holds_four_times_float32_s_blocks(random_model_dir):
    model, args = str(random_model_dir("llama")), dict(max_model_len=256, kv_cache_memory=1 << 20)
    blocks = {kv: LLM(model, kv_cache_dtype=kv, **args).engine.num_blocks for kv in ("auto", "bfloat16", "fp8")}
    assert blocks["fp8"] == 4 * blocks["auto"] == 2 * blocks["bfloat16"]
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) == kv_cache_torch_dtype("fp8", torch.float32) == FP8


def test_the_cpu_backend_gives_the_reference_s_tokens_over_an_fp8_cache(random_model_dir):
    if not cpu_ops.available():
        pytest.skip("cb_serve CPU kernels did not build here")
    model = str(random_model_dir("llama"))
    prompts, max_tokens = make_prompts(list(range(100, 40000)), seed=7)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    tokens = {}
    for backend in ("cpu", "torch"):
        llm = LLM(model, attention_backend=backend, kv_cache_dtype="fp8", **STRESS_ENGINE_ARGS)
        assert all(c.dtype == FP8 for c in llm.engine.runner.kv_caches)
        with counter_deltas(llm.engine) as deltas:
            tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        check_engine_exercised(llm, prompts, deltas)
        stats = llm.engine.get_stats()
        assert stats.kv_blocks_used == 0, "blocks leaked"
    assert tokens["cpu"] == tokens["torch"]


def test_what_it_cannot_serve_is_refused(random_model_dir):
    model = str(random_model_dir("llama"))
    with pytest.raises(ValueError, match="Unknown kv_cache_dtype 'fp8_e5m2'"):
        LLM(model, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype=fp8 differs from the model dtype torch.bfloat16"):
        LLM(model, dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=128)
