"""Structured outputs (issue 23, acceptance 5): what JSON-schema constraints cost cb-serve, in one process on
one workload, with the built-in model (SmolLM2-135M-Instruct) through ``LLM.generate``.

Workload: ``--num-requests`` chat prompts (64; ``--quick``: 8), request ``i`` asking for a realistic JSON
instance of schema ``i % 41`` of ``tests/json_schemas.py``'s ``SCHEMAS`` (its title or name and its
top-level keys; the schema itself is not in the prompt, so prefill stays small and the decode steps, where
the masks are, dominate), rendered by the model's chat template once; greedy, ``--max-tokens`` (128) each,
all submitted at once. Three variants of the same prompts:

  constrained      each request constrained by its schema (``StructuredOutputsParams(json=...)``): it ends
                   when its grammar completes (finish reason "stop") or at ``max_tokens`` ("length")
  unconstrained    no constraint, ends at EOS or ``max_tokens`` (different output lengths: not comparable
                   in wall time, only in tokens/s and step time)
  matched          no constraint, ``ignore_eos=True`` and ``max_tokens`` = the constrained run's output
                   length of that request: exactly the constrained run's token counts, hence the same
                   batch sizes step by step. **Headline: constrained wall / matched wall** (goal <= 1.10)

Before timing: one short unconstrained and one short constrained generate, and every schema compiled
once into the engine's grammar cache (steady state: a server sees the same schemas again; cold compile
is measured apart, below); the prefix cache is cleared before every timed run. Repeats (``--repeats``,
2) alternate constrained, unconstrained, matched; each variant reports its **best** (shortest) wall
time and the step statistics of that run, and lists every repeat.

Also measured:
  * step time at comparable batch sizes: decode-only steps grouped by running sequences, mean and p50
    per variant; the step phases (``StepPhases``) per variant, to see where extra time goes
  * masks per step with constrained rows, from the engine's ``StepStats``: ``grammar_fill_s`` (the
    filler thread's wall seconds for the step's bitmask), ``grammar_wait_s`` (what sampling waited for it
    after the forward) and ``num_constrained_seqs``: p50/p99 of the fill per step and per constrained row,
    and of the wait; the bitmask apply in the sampler (``sampler.apply_bitmask``) timed by a wrapper
  * compile time: every schema of the suite compiled once, cold (llguidance keeps no grammar cache), with
    the engine's backend (``LLGuidanceBackend(tokenizer, vocab_size).compile``, which computes a first
    mask to check the grammar), after an untimed warm-up compile; also compile + a sequence's first mask.
    p50/p90/p99/max (numpy's linear percentiles); the tokenizer wrapping (once per backend) apart
  * correctness: every constrained output that finished with "stop" must parse as JSON and validate
    against its schema (``jsonschema``, the validator of the schema's draft, with its format checker);
    the script exits 1 if one does not, or if a constrained request failed
  * the CPU (model name, ``amx_tile``), torch version and threads, the foreign CPU share of each run

Run from the repository root on an otherwise idle machine (full run: ~5-8 min on 2 cores):
    .venv/bin/python bench/structured_bench.py --out bench/results/structured_bench.json
    .venv/bin/python bench/structured_bench.py --quick --out /tmp/sb.json      # smoke test, ~1 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from cb_offline import engine_kwargs, summarize_steps
from grammar_backends import summary, validate
from schemas import SCHEMAS
from step_phases import PHASES, breakdown

import cb_serve.model_executor.sampler as sampler_module
from cb_serve import LLM, SamplingParams, StepStats
from cb_serve.benchmarks.cpu_accounting import CONTENTION_WARNING, Timer
from cb_serve.benchmarks.report import cb_serve_source, log, run_info, write_json
from cb_serve.config import EngineConfig
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.outputs import RequestOutput
from cb_serve.structured_outputs import StructuredOutputsParams
from cb_serve.structured_outputs.llguidance_backend import LLGuidanceBackend

VARIANTS = ("constrained", "unconstrained", "matched", "constrained_no_jf")
KEY_HEAVY_REQUESTS = 16  # the jump-forward comparison on the suite's key-heavy schemas alone
GOAL = 1.10  # constrained / matched wall time
SYSTEM_PROMPT = "You reply with one JSON value and nothing else."
BATCH_BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 128), (129, 256))
TRIVIAL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve"
    )
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--quick", action="store_true", help="Smoke test: 8 requests, max_tokens 32.")
    parser.add_argument("--num-requests", type=int, help="Requests per run (default: 64; --quick: 8).")
    parser.add_argument("--max-tokens", type=int, help="max_tokens of every request (default: 128; --quick: 32).")
    parser.add_argument("--repeats", type=int, default=2, help="Timed runs of each variant, alternating (default: 2).")
    parser.add_argument(
        "--out", default="bench/results/structured_bench.json", help="JSON result (default: %(default)s)."
    )
    args = parser.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 64
    if args.max_tokens is None:
        args.max_tokens = 32 if args.quick else 128
    if min(args.num_requests, args.max_tokens, args.repeats) < 1:
        parser.error("--num-requests, --max-tokens and --repeats must be positive")
    return args


# ---- environment ------------------------------------------------------------------------------------------------
def cpu_info() -> dict[str, Any]:
    """The CPU model and the flags that pick cb-serve's kernels (``/proc/cpuinfo``), and torch's threads."""
    model, flags = cpu_model_and_flags()
    return {
        "model_name": model,
        "amx_tile": "amx_tile" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "avx512f": "avx512f" in flags,
        "logical_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }


# ---- workload ---------------------------------------------------------------------------------------------------
def request_schemas(num_requests: int) -> list[tuple[str, dict]]:
    return [SCHEMAS[i % len(SCHEMAS)] for i in range(num_requests)]


def messages_for(i: int, name: str, schema: dict) -> list[dict[str, str]]:
    """A chat asking for a JSON instance of ``schema`` (described, not quoted); later rounds over the suite
    ask for another example, so no two prompts are identical."""
    what = schema.get("title") or name.replace("_", " ")
    keys = list(schema.get("properties", {}))
    ask = f"Write a realistic example of a {what} as JSON"
    ask += f" with the keys {', '.join(keys)}." if keys else "."
    if i >= len(SCHEMAS):
        ask += f" Make it a different one than usual (example {i // len(SCHEMAS) + 1})."
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ask}]


def constrained_params(schema: dict, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=schema))


def variant_params(
    variant: str, schemas: list[tuple[str, dict]], max_tokens: int, lengths: list[int] | None
) -> list[SamplingParams]:
    if variant in ("constrained", "constrained_no_jf"):
        return [constrained_params(schema, max_tokens) for _, schema in schemas]
    if variant == "unconstrained":
        return [SamplingParams(temperature=0, max_tokens=max_tokens) for _ in schemas]
    assert lengths is not None
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]


# ---- what each step did ----------------------------------------------------------------------------------------
class ApplyProbe:
    """Times ``apply_grammar`` in the sampler (the masked rows' logits set to -inf)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        apply = sampler_module.apply_grammar

        def timed_apply(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return apply(*a, **k)
            finally:
                self.seconds.append(time.perf_counter() - t0)

        sampler_module.apply_grammar = timed_apply

    def take(self) -> float:
        got = self.seconds[:]
        del self.seconds[: len(got)]
        return sum(got)


@dataclasses.dataclass
class StepRecord:
    stats: StepStats
    constrained_rows: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0


def step_recorder(apply_probe: ApplyProbe) -> tuple[list[StepRecord], Callable]:
    records: list[StepRecord] = []

    def listener(stats: StepStats, _outputs: object) -> None:
        rows, fill_s, wait_s = stats.num_constrained_seqs, stats.grammar_fill_s, stats.grammar_wait_s
        records.append(StepRecord(stats, rows, fill_s, wait_s, apply_probe.take()))

    return records, listener


# ---- runs --------------------------------------------------------------------------------------------------------
def timed_generate(
    llm: LLM,
    prompts: list[list[int]],
    params: list[SamplingParams],
    listener: Callable,
    records: list[StepRecord],
    jump_forward: bool = True,
) -> tuple[list[RequestOutput], Timer, list[StepRecord]]:
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()  # every run prefills its prompts: no hits from earlier ones
    records.clear()
    engine.add_step_listener(listener)
    jump = engine.structured.enable_jump_forward
    engine.structured.enable_jump_forward = jump and jump_forward
    try:
        with Timer() as timer:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.structured.enable_jump_forward = jump
        engine.remove_step_listener(listener)
    return outputs, timer, list(records)


def _appender(steps: list[StepStats]) -> Callable:
    return lambda stats, _outputs: steps.append(stats)


def key_heavy_jump_forward(llm: LLM, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Jump-forward on and off over the suite's key-heavy schemas alone (long fixed keys):
    best wall of ``repeats``, steps, forced tokens; the outputs must be the same tokens."""
    heavy = [(n, s) for n, s in SCHEMAS if n.startswith("key_heavy")]
    schemas = [heavy[i % len(heavy)] for i in range(KEY_HEAVY_REQUESTS)]
    prompts = [llm.apply_chat_template(messages_for(i, n, s)) for i, (n, s) in enumerate(schemas)]
    params = [constrained_params(s, max_tokens) for _, s in schemas]
    result: dict[str, Any] = {"schemas": sorted({n for n, _ in schemas}), "requests": len(schemas)}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(repeats):
        for on in (True, False):
            records: list[StepRecord] = []
            steps: list[StepStats] = []
            outputs, timer, _ = timed_generate(llm, prompts, params, _appender(steps), records, jump_forward=on)
            tokens[on] = [list(o.outputs[0].token_ids) for o in outputs]
            key = "on" if on else "off"
            run = {"wall_s": timer.wall_s, "steps": len(steps), "output_tokens": sum(map(len, tokens[on])),
                   "forced_tokens": sum(s.jump_forward_tokens for s in steps)}  # fmt: skip
            if key not in result or run["wall_s"] < result[key]["wall_s"]:
                result[key] = run
    assert tokens[True] == tokens[False], "jump-forward changed the output"
    result["speedup"] = result["off"]["wall_s"] / result["on"]["wall_s"]
    return result


def ms(values: list[float]) -> dict[str, Any]:
    """``summary`` (n, p50, p90, p99, max, mean) of seconds, in milliseconds."""
    return summary([1e3 * v for v in values])


def by_batch_size(steps: list[StepRecord]) -> dict[str, dict[str, Any]]:
    """Decode-only steps grouped by running sequences: count, mean and p50 step ms."""
    out = {}
    for lo, hi in BATCH_BUCKETS:
        group = [
            1e3 * r.stats.duration_s for r in steps if not r.stats.num_prefill_tokens and lo <= r.stats.num_seqs <= hi
        ]
        if group:
            out[f"{lo}-{hi}"] = {
                "steps": len(group),
                "mean_ms": statistics.fmean(group),
                "p50_ms": float(np.percentile(group, 50)),
            }
    return out


def run_summary(outputs: list[RequestOutput], timer: Timer, steps: list[StepRecord]) -> dict[str, Any]:
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    reasons: dict[str, int] = {}
    for o in outputs:
        reasons[str(o.outputs[0].finish_reason)] = reasons.get(str(o.outputs[0].finish_reason), 0) + 1
    stats = [r.stats for r in steps]
    decode = [r for r in steps if not r.stats.num_prefill_tokens]
    return {
        "wall_s": timer.wall_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / timer.wall_s,
        "finish_reasons": reasons,
        **timer.to_json(),
        "steps": summarize_steps(stats),
        "decode_step_ms": ms([r.stats.duration_s for r in decode]),
        "decode_steps_by_batch_size": by_batch_size(steps),
        "phases": breakdown(stats),
        "grammar": grammar_summary(steps),
    }


def grammar_summary(steps: list[StepRecord]) -> dict[str, Any]:
    """Mask fill, wait and apply per step with constrained rows (empty when none had any)."""
    masked = [r for r in steps if r.constrained_rows]
    if not masked:
        return {}
    fill = sum(r.fill_s for r in masked)
    return {
        "steps_with_masks": len(masked),
        "mean_constrained_rows": statistics.fmean(r.constrained_rows for r in masked),
        "fill_ms_per_step": ms([r.fill_s for r in masked]),
        "fill_us_per_row": summary([1e6 * r.fill_s / r.constrained_rows for r in masked]),
        "wait_ms_per_step": ms([r.wait_s for r in masked]),
        "apply_ms_per_step": ms([r.apply_s for r in masked]),
        "fill_s_total": fill,
        "wait_s_total": sum(r.wait_s for r in masked),
        "apply_s_total": sum(r.apply_s for r in masked),
        "fill_hidden_share": 1 - sum(r.wait_s for r in masked) / fill if fill else None,
        "step_s_total": sum(r.stats.duration_s for r in steps),
    }


def check_outputs(
    schemas: list[tuple[str, dict]], outputs: list[RequestOutput]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every constrained output that stopped must be JSON valid under its schema."""
    per_request, failures = [], []
    for i, ((name, schema), out) in enumerate(zip(schemas, outputs)):
        comp = out.outputs[0]
        row: dict[str, Any] = {"schema": name, "tokens": len(comp.token_ids), "finish_reason": comp.finish_reason}
        if comp.finish_reason == "stop":
            row["valid"], row["error"] = validate(schema, comp.text)
            if not row["valid"]:
                failures.append({"request": i, "schema": name, "error": row["error"], "text": comp.text[:500]})
        elif comp.finish_reason != "length":
            row["error"] = str(out.error)
            failures.append({"request": i, "schema": name, "error": f"finished {comp.finish_reason}: {out.error}"})
        per_request.append(row)
    stopped = [r for r in per_request if r["finish_reason"] == "stop"]
    return {
        "requests": len(outputs),
        "finished_stop": len(stopped),
        "finished_length": sum(r["finish_reason"] == "length" for r in per_request),
        "validated": sum(bool(r.get("valid")) for r in stopped),
        "failures": failures,
    }, per_request


def measure_compile(llm: LLM) -> dict[str, Any]:
    """Each schema of the suite compiled once, cold, with the engine's backend (a fresh one, no cache)."""
    t0 = time.perf_counter()
    backend = LLGuidanceBackend(llm.engine.tokenizer, llm.engine.hf_config.vocab_size)
    setup_s = time.perf_counter() - t0
    bitmask = torch.full((1, (backend.vocab_size + 31) // 32), -1, dtype=torch.int32)
    backend.compile(StructuredOutputsParams(json=TRIVIAL_SCHEMA)).matcher().fill_bitmask(bitmask, 0)  # warm-up
    per_schema: dict[str, dict[str, Any]] = {}
    for name, schema in SCHEMAS:
        params = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(params)
            t1 = time.perf_counter()
            compiled.matcher().fill_bitmask(bitmask, 0)
            t2 = time.perf_counter()
            per_schema[name] = {"ok": True, "compile_ms": 1e3 * (t1 - t0), "compile_first_mask_ms": 1e3 * (t2 - t0)}
        except Exception as e:  # a schema the backend refuses is reported, the rest still measured
            per_schema[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    ok = [r for r in per_schema.values() if r["ok"]]
    return {
        "backend": backend.name,
        "tokenizer_setup_s": setup_s,
        "compiled": len(ok),
        "failed": len(per_schema) - len(ok),
        "compile_ms": summary([r["compile_ms"] for r in ok]),
        "compile_first_mask_ms": summary([r["compile_first_mask_ms"] for r in ok]),
        "per_schema": per_schema,
    }


def warm_up(llm: LLM, prompts: list[list[int]], schemas: list[tuple[str, dict]]) -> float:
    """Short generates of both kinds, then every distinct schema compiled into the engine's grammar cache."""
    t0 = time.perf_counter()
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.generate([prompts[0]], constrained_params(schemas[0][1], 4), use_tqdm=False)
    compiler = llm.engine.structured.compiler
    distinct = {name: schema for name, schema in schemas}
    for future in [compiler.submit(StructuredOutputsParams(json=s)) for s in distinct.values()]:
        future.result()
    return time.perf_counter() - t0


# ---- report ------------------------------------------------------------------------------------------------------
def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def markdown(out: dict[str, Any]) -> str:
    best = out["best"]
    cpu = out["cpu"]
    lines = [
        f"structured outputs, {out['workload']['num_requests']} requests x max_tokens "
        f"{out['workload']['max_tokens']}, greedy; best of {out['repeats']} alternating runs; "
        f"{cpu['model_name']} (amx_tile: {'yes' if cpu['amx_tile'] else 'no'}), torch {cpu['torch']}, "
        f"{cpu['torch_threads']} threads",
        "",
        "| run | wall s | output tokens | output tok/s | steps | mean decode step ms | p50 decode step ms "
        "| foreign CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        r = best[v]
        share = r["foreign_cpu_share"]
        lines.append(
            f"| {v} | {r['wall_s']:.2f} | {r['output_tokens']:,} | {r['output_tok_s']:.1f} | "
            f"{r['steps']['num_steps']} | {fmt(r['decode_step_ms']['mean'], 2)} | {fmt(r['decode_step_ms']['p50'], 2)} "
            f"| {'n/a' if share is None else f'{share:.1%}'} |"
        )
    ratio = out["headline"]["constrained_over_matched_wall"]
    lines += [
        "",
        f"**constrained / matched wall: {ratio:.3f}** (goal <= {GOAL:.2f}: "
        f"{'met' if ratio <= GOAL else 'NOT met'}); output tok/s constrained / unconstrained(EOS): "
        f"{out['headline']['constrained_over_unconstrained_tok_s']:.3f}; jump-forward speedup (constrained_no_jf / "
        f"constrained wall): {out['headline']['jump_forward_speedup']:.3f}",
        "",
        "| decode steps by running seqs | " + " | ".join(f"{v} mean / p50 ms (steps)" for v in VARIANTS) + " |",
        "|---|" + "---:|" * len(VARIANTS),
    ]
    buckets = [f"{lo}-{hi}" for lo, hi in BATCH_BUCKETS]
    for b in buckets:
        cells = [best[v]["decode_steps_by_batch_size"].get(b) for v in VARIANTS]
        if not any(cells):
            continue
        text = [f"{c['mean_ms']:.2f} / {c['p50_ms']:.2f} ({c['steps']})" if c else "-" for c in cells]
        lines.append(f"| {b} | " + " | ".join(text) + " |")
    lines += ["", "| phase ms per step (all steps) | " + " | ".join(VARIANTS) + " |", "|---|" + "---:|" * len(VARIANTS)]
    for phase in PHASES:
        vals = [best[v]["phases"]["all steps"]["phase_ms_per_step"][phase] for v in VARIANTS]
        lines.append(f"| {phase} | " + " | ".join(f"{x:.2f}" for x in vals) + " |")
    g = best["constrained"]["grammar"]
    comp = out["compile"]
    val = out["validation"]
    kh = out["key_heavy_jump_forward"]
    if g:
        lines += [
            "",
            "| masks, constrained run | p50 | p99 | max | mean |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {label} | {fmt(s['p50'], d)} | {fmt(s['p99'], d)} | {fmt(s['max'], d)} | {fmt(s['mean'], d)} |"
                for label, s, d in (
                    ("fill ms per step", g["fill_ms_per_step"], 3),
                    ("fill us per constrained row", g["fill_us_per_row"], 1),
                    ("sampling's wait ms per step", g["wait_ms_per_step"], 3),
                    ("apply ms per step", g["apply_ms_per_step"], 3),
                )
            ),
            f"\n{g['steps_with_masks']} steps with masks, {g['mean_constrained_rows']:.1f} constrained rows on "
            f"average; fill {g['fill_s_total']:.2f} s, waited {g['wait_s_total']:.2f} s "
            f"({fmt(None if g['fill_hidden_share'] is None else 100 * g['fill_hidden_share'])}% of the fill hidden "
            f"behind the forward), apply {g['apply_s_total']:.2f} s, of {g['step_s_total']:.2f} s of steps",
        ]
    c, cf = comp["compile_ms"], comp["compile_first_mask_ms"]
    lines += [
        "",
        f"| compile, cold ({comp['compiled']}/{comp['compiled'] + comp['failed']} schemas) | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|",
        f"| compile ms | {fmt(c['p50'], 2)} | {fmt(c['p90'], 2)} | {fmt(c['p99'], 2)} | {fmt(c['max'], 2)} |",
        f"| compile + first mask ms | {fmt(cf['p50'], 2)} | {fmt(cf['p90'], 2)} | {fmt(cf['p99'], 2)} "
        f"| {fmt(cf['max'], 2)} |",
        "",
        f"jump-forward on the key-heavy schemas ({kh['requests']} requests of {', '.join(kh['schemas'])}): "
        f"on {kh['on']['wall_s']:.2f} s / {kh['on']['steps']} steps ({kh['on']['forced_tokens']} of "
        f"{kh['on']['output_tokens']} tokens forced), off {kh['off']['wall_s']:.2f} s / {kh['off']['steps']} steps: "
        f"**{kh['speedup']:.2f}x**, the same tokens",
        "",
        f"validation: {val['finished_stop']}/{val['requests']} constrained outputs finished (stop), "
        f"{val['validated']} of them valid against their schema; {val['finished_length']} hit max_tokens",
    ]
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    wall_start = time.perf_counter()
    log(f"structured-outputs benchmark, {started}: {' '.join(sys.argv)}")
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    log(f"cb-serve loaded in {time.perf_counter() - t0:.1f} s")
    cpu = cpu_info()
    log(f"cpu: {json.dumps(cpu)}")

    schemas = request_schemas(args.num_requests)
    prompts = [llm.apply_chat_template(messages_for(i, n, s)) for i, (n, s) in enumerate(schemas)]
    log(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, max_tokens {args.max_tokens}")

    log("compiling the suite, cold ...")
    compile_result = measure_compile(llm)
    c = compile_result["compile_ms"]
    log(
        f"compile ms over {compile_result['compiled']} schemas: p50 {fmt(c['p50'], 2)}, p90 {fmt(c['p90'], 2)}, "
        f"p99 {fmt(c['p99'], 2)}, max {fmt(c['max'], 2)} ({compile_result['failed']} failed)"
    )

    apply_probe = ApplyProbe()
    records, listener = step_recorder(apply_probe)
    log(f"warm-up (short generates, grammar cache) in {warm_up(llm, prompts, schemas):.1f} s")
    apply_probe.take()

    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    checks: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    lengths: list[int] | None = None
    lengths_stable = True
    for rep in range(args.repeats):
        for variant in VARIANTS:
            params = variant_params(variant, schemas, args.max_tokens, lengths)
            outputs, timer, steps = timed_generate(
                llm, prompts, params, listener, records, jump_forward=variant != "constrained_no_jf"
            )
            result = run_summary(outputs, timer, steps)
            runs[variant].append(result)
            if variant == "constrained":
                got = [len(o.outputs[0].token_ids) for o in outputs]
                lengths_stable &= lengths is None or got == lengths
                lengths = lengths or got
                checks.append(check_outputs(schemas, outputs))
            if variant == "matched":
                assert result["output_tokens"] == sum(lengths or []), "matched run produced other token counts"
            if variant == "constrained_no_jf":  # jump-forward changes no token
                assert [len(o.outputs[0].token_ids) for o in outputs] == lengths, "jump-forward changed the output"
            log(
                f"[{rep + 1}/{args.repeats}] {variant:13s} {result['wall_s']:7.2f} s, {result['output_tokens']:6d} "
                f"tokens, {result['output_tok_s']:6.1f} tok/s, {result['steps']['num_steps']} steps, finish "
                f"{result['finish_reasons']}, foreign CPU {fmt(100 * (result['foreign_cpu_share'] or 0))}%"
            )

    best = {v: min(rs, key=lambda r: r["wall_s"]) for v, rs in runs.items()}
    validation, per_request = checks[0]
    failures = [f for check, _ in checks for f in check["failures"]]
    out = {
        **run_info(started),
        "cb_serve": cb_serve_source(),
        "cpu": cpu,
        "engine_args": engine_kwargs(args),
        "workload": {
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            "prompt_tokens": sum(map(len, prompts)),
            "schemas": len({n for n, _ in schemas}),
            "constrained_lengths": lengths,
            "constrained_lengths_stable_across_repeats": lengths_stable,
        },
        "repeats": args.repeats,
        "statistic": "best (shortest wall) of the repeats; every repeat in 'runs'",
        "headline": {
            "constrained_over_matched_wall": best["constrained"]["wall_s"] / best["matched"]["wall_s"],
            "constrained_over_unconstrained_tok_s": (
                best["constrained"]["output_tok_s"] / best["unconstrained"]["output_tok_s"]
            ),
            "jump_forward_speedup": best["constrained_no_jf"]["wall_s"] / best["constrained"]["wall_s"],
            "goal": GOAL,
        },
        "best": best,
        "runs": runs,
        "key_heavy_jump_forward": key_heavy_jump_forward(llm, args.max_tokens, args.repeats),
        "compile": compile_result,
        "validation": {**validation, "failures": failures},
        "per_request": per_request,
        "total_wall_s": time.perf_counter() - wall_start,
    }
    write_json(args.out, out)
    log("")
    log(markdown(out))
    shares = [r["foreign_cpu_share"] or 0.0 for rs in runs.values() for r in rs]
    if max(shares) > CONTENTION_WARNING:
        log(
            f"WARNING: other processes kept up to {max(shares):.0%} of the CPUs busy during a run; "
            "the timings are not representative (rerun on an idle machine)."
        )
    log(f"total {out['total_wall_s']:.0f} s")
    if failures:
        log(f"FAILED: {len(failures)} constrained output(s) invalid or failed:")
        for f in failures[:10]:
            log(f"  {json.dumps(f)[:400]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
