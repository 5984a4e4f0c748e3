"""cb-serve in process (``LLM.generate``): engine arguments from the command line, the untimed warmup,
step recording through the engine's step-listener interface, the offline throughput run (with its
decode-only steps for the DRAM bandwidth bound), and batch invariance (requests run again one at a time)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cb_serve import LLM, SamplingParams, StepStats
from cb_serve.benchmarks.bandwidth import DecodeStep, decode_bound, decode_steps, kv_bytes_per_token
from cb_serve.benchmarks.cpu_accounting import Timer
from cb_serve.benchmarks.report import SystemResult, batch_invariance, make_result
from cb_serve.benchmarks.workload import Workload, warmup_prompt
from cb_serve.config import EngineConfig


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields of parsed arguments (``EngineConfig.add_cli_args``)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored), as every benchmark request."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def warm_up(llm: LLM, workload: Workload) -> None:
    """One short untimed request; then the prefix cache is cleared so its prompt cannot become a hit."""
    llm.generate([warmup_prompt(workload)], greedy(2), use_tqdm=False)
    llm.engine.block_manager.reset_prefix_cache()


@contextmanager
def recording_steps(llm: LLM) -> Iterator[list[StepStats]]:
    """The ``StepStats`` of every engine step while the block runs (a step listener, removed after)."""
    steps: list[StepStats] = []

    def listener(stats: StepStats, _outputs: object) -> None:
        steps.append(stats)

    llm.engine.add_step_listener(listener)
    try:
        yield steps
    finally:
        llm.engine.remove_step_listener(listener)


def summarize_steps(steps: list[StepStats]) -> dict[str, Any]:
    with_prefill = [s for s in steps if s.num_prefill_tokens]
    decode_only = [s for s in steps if not s.num_prefill_tokens]
    return {
        "num_steps": len(steps),
        "mean_tokens_per_step": statistics.fmean(s.num_scheduled_tokens for s in steps),
        "mean_budget_fill": statistics.fmean(s.budget_fill for s in steps),
        "mean_seqs_per_step": statistics.fmean(s.num_seqs for s in steps),
        "max_seqs_per_step": max(s.num_seqs for s in steps),
        "steps_with_prefill": len(with_prefill),
        "decode_only_steps": len(decode_only),
        "mean_step_ms": 1e3 * statistics.fmean(s.duration_s for s in steps),
        "mean_prefill_step_ms": 1e3 * statistics.fmean(s.duration_s for s in with_prefill) if with_prefill else 0.0,
        "mean_decode_step_ms": 1e3 * statistics.fmean(s.duration_s for s in decode_only) if decode_only else 0.0,
        "mean_decode_step_seqs": statistics.fmean(s.num_seqs for s in decode_only) if decode_only else 0.0,
        "preempted_in_steps": sum(s.num_preempted for s in steps),
    }


def run_cb_serve(llm: LLM, workload: Workload) -> SystemResult:
    """The workload through ``llm.generate``, all requests at once; timed after a warmup."""
    return run_cb_serve_steps(llm, workload)[0]


def run_cb_serve_steps(llm: LLM, workload: Workload) -> tuple[SystemResult, list[DecodeStep]]:
    """``run_cb_serve``, plus its decode-only steps with each sequence's context (from the batch
    inspector's step records, read after the timed run; none when the inspector is off)."""
    engine = llm.engine
    warm_up(llm, workload)
    before = engine.get_stats()
    first_step = engine.num_steps + 1  # the listener sees consecutive steps from here
    params = [greedy(n) for n in workload.output_lens]
    with recording_steps(llm) as steps, Timer() as timer:
        outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    after = engine.get_stats()
    records = engine.inspect("steps", after_step=first_step - 1, limit=len(steps)) or []
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    result = make_result(
        "cb-serve",
        timer,
        workload,
        token_ids,
        **summarize_steps(steps),
        preemptions=after.num_preemptions - before.num_preemptions,
        prefix_cache_hit_tokens=after.prefix_cache_hits - before.prefix_cache_hits,
        kv_blocks=engine.num_blocks,
        block_size=engine.block_size,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        max_num_seqs=engine.config.max_num_seqs,
    )
    return result, decode_steps(steps, records, first_step)


def sequential_outputs(llm: LLM, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
    """Each request alone (one in flight, the prefix cache cleared first so its prompt is computed
    alone too): its greedy output tokens."""
    outputs = []
    for prompt, n in zip(prompts, output_lens):
        llm.engine.block_manager.reset_prefix_cache()
        out = llm.generate([prompt], greedy(n), use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
    return outputs


def check_batch_invariance(llm: LLM, workload: Workload, result: SystemResult, num_requests: int) -> None:
    """Runs the first ``num_requests`` requests again one at a time; records in ``result.extra``
    (``batch_invariance``) how many produced the same tokens as in the batched run."""
    k = min(num_requests, workload.num_requests)
    alone = sequential_outputs(llm, workload.prompts[:k], workload.output_lens[:k])
    result.extra["batch_invariance"] = batch_invariance(result.outputs[:k], alone)


def decode_bandwidth_bound(llm: LLM, steps: list[DecodeStep], read_gb_s: float) -> dict[str, Any] | None:
    """``bandwidth.decode_bound`` of cb-serve's decode steps on its model and KV-cache dtype."""
    engine = llm.engine
    per_token = kv_bytes_per_token(engine.hf_config, engine.kv_cache_dtype)
    return decode_bound(engine.runner.model, per_token, steps, read_gb_s)
