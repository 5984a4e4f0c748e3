"""HF transformers baselines, on the model cb-serve loads, greedy with EOS ignored: static batching
(``hf_static_batch``: ``model.generate`` on a left-padded batch with ``max_new_tokens`` = the batch's
longest output, of which only each request's own output tokens count; ``run_hf_static`` runs a workload
in batches in arrival order, ``hf_serving`` serves a trace with it) and transformers' continuous batching
(``run_hf_continuous``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cb_serve.benchmarks.cpu_accounting import Timer
from cb_serve.benchmarks.report import SystemResult, make_result
from cb_serve.benchmarks.workload import Workload, warmup_prompt
from cb_serve.model_executor import loader

HF_STATIC_BATCH_SIZE = 16


def load_hf_model(source: loader.ModelSource, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **source.hf_kwargs())
    return model.eval().requires_grad_(False)


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token, else its EOS token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


@contextmanager
def eos_disabled(model) -> Iterator[None]:
    """No EOS stopping (greedy tokens stay unaltered, unlike with min_new_tokens). generate() fills an unset
    eos_token_id from the model's generation_config, so clear it there too: otherwise rows stop at EOS and
    are padded while the rest of the batch goes on."""
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def hf_static_batch(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, streamer=None) -> torch.Tensor:
    """One static left-padded greedy ``generate`` batch (inside ``eos_disabled``); the new tokens
    ``[len(prompts), max_new_tokens]``."""
    from transformers import GenerationConfig

    input_ids, mask = left_pad(prompts, pad_id)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id, use_cache=True
    )
    out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, streamer=streamer)
    return out[:, input_ids.shape[1] :]


@torch.inference_mode()
def run_hf_static(model, tokenizer, workload: Workload, batch_size: int) -> SystemResult:
    tokenizer.padding_side = "left"
    pad_id = pad_token_id(tokenizer)
    with eos_disabled(model):
        hf_static_batch(model, [warmup_prompt(workload)], 2, pad_id)
        outputs: list[list[int]] = []
        padding = wasted = 0
        with Timer() as timer:
            for b in range(0, workload.num_requests, batch_size):
                prompts = workload.prompts[b : b + batch_size]
                lens = workload.output_lens[b : b + batch_size]
                new = hf_static_batch(model, prompts, max(lens), pad_id)
                if new.shape[1] != max(lens):
                    raise RuntimeError(f"hf-static: generated {new.shape[1]} tokens, expected {max(lens)}.")
                outputs.extend(new[row, :n].tolist() for row, n in enumerate(lens))
                padding += sum(max(len(p) for p in prompts) - len(p) for p in prompts)
                wasted += sum(max(lens) - n for n in lens)
    return make_result(
        "hf-static",
        timer,
        workload,
        outputs,
        batch_size=batch_size,
        padding_tokens=padding,
        wasted_decode_tokens=wasted,
    )


# ---- HF continuous batching -----------------------------------------------------------------------------------
def run_hf_continuous(model, workload: Workload, api: str) -> SystemResult:
    """``api="manager"``: one ``add_request`` per request with its own ``max_new_tokens``;
    ``"generate_batch"``: ``model.generate_batch`` with the largest output length for every request."""
    from transformers import GenerationConfig

    # eos_token_id=None: the continuous-batching manager then disables EOS (-1).
    config = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=None)
    if api == "generate_batch":
        return _run_generate_batch(model, workload, config)
    setup_start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=30, warmup=True, workload_hints=_workload_hints(workload)
    ) as manager:
        setup = time.perf_counter() - setup_start
        cb_config = manager.continuous_batching_config
        with Timer() as timer:
            outputs = _serve_all(manager, workload)
    return make_result(
        "hf-continuous",
        timer,
        workload,
        outputs,
        api=api,
        timed="add_request..last result (manager setup + warmup excluded)",
        setup_and_warmup_s=setup,
        page_size=cb_config.page_size,
        num_blocks=cb_config.num_blocks,
        max_batch_tokens=cb_config.max_batch_tokens,
        max_requests_per_batch=cb_config.max_requests_per_batch,
        attn_implementation=model.config._attn_implementation,
    )


def _workload_hints(workload: Workload):
    from transformers.generation.continuous_batching.utils import WorkloadHints

    return WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(workload.output_lens),
        num_requests=workload.num_requests,
    )


def _serve_all(manager, workload: Workload) -> list[list[int]]:
    """Adds every request to the running manager and waits for all results; their tokens in order."""
    ids = [
        manager.add_request(prompt, request_id=f"bench_{i}", max_new_tokens=n)
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens))
    ]
    results: dict[str, Any] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"hf-continuous: request {result.request_id} failed: {result.error}")
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("hf-continuous: the generation thread died.")
    return [list(results[i].generated_tokens) for i in ids]


def _run_generate_batch(model, workload: Workload, config) -> SystemResult:
    # One max_new_tokens for every request: each generates max_len tokens, only its own count.
    with Timer() as timer:
        results = model.generate_batch(inputs=workload.prompts, generation_config=config, progress_bar=False)
    ordered = list(results.values())
    if len(ordered) != workload.num_requests:
        raise RuntimeError(f"hf-continuous: {len(ordered)} of {workload.num_requests} requests came back.")
    outputs = [list(r.generated_tokens)[:n] for r, n in zip(ordered, workload.output_lens)]
    wasted = workload.num_requests * max(workload.output_lens) - workload.output_tokens
    return make_result(
        "hf-continuous",
        timer,
        workload,
        outputs,
        api="generate_batch",
        timed="generate_batch incl. warmup",
        wasted=wasted,
    )
