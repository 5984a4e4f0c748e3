"""Where one cb-serve engine step spends its time, from the engine's step listeners and torch.profiler.

Runs the throughput benchmark's workload (same flags and seed as ``bench/throughput.py``) through cb-serve
only, with a step listener (``LLMEngine.add_step_listener``) recording each step's ``StepStats``, whose
``phases`` the engine times itself:

  schedule   the scheduler's decisions
  prepare    building the batch's tensors (token ids, positions, block tables, slot mapping)
  execute    the model forward, logits, sampling and the scheduler's update after the step
  output     appending tokens, the stops that need no text, making the records (the front end's
             detokenizing, stop strings and outputs run after the step: in ``outside_steps_s``)

and then runs ``torch.profiler`` over the first step and a few decode-only steps of a second workload
(seed + 1, so prompts do not hit the prefix cache) for an operator-level view: the split inside the model
(attention, GEMMs, small ops; ``bench/op_profile.py``), also rolled up by kind.

Changed from the earlier version, which monkeypatched timers around engine internals: ``execute`` is what
it split into "forward (non-attention)", "attention", "logits", "sampling", "execute (other)" and
"update"; ``output`` is its "append_token", "detokenize" and "make_output"; its "rest" (step wall time
outside those timers) is gone, the four phases are the whole step. The time ``LLM.generate`` spends
outside engine steps is reported instead (``outside_steps_s``), and the op profile adds ``op_kinds``.

Run from the repository root (about 2-3 minutes for 64 requests on 2 cores; needs an otherwise idle machine):
    .venv/bin/python bench/profile_step.py
    .venv/bin/python bench/profile_step.py --num-requests 16 --max-num-batched-tokens 1024 --json /tmp/prof.json
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from cb_offline import engine_kwargs, greedy, recording_steps, warm_up
from op_profile import op_profile
from step_phases import breakdown, print_breakdown
from throughput import parse_args

from cb_serve import LLM, StepStats
from cb_serve.benchmarks.cpu_accounting import Timer
from cb_serve.benchmarks.report import cb_serve_source, log, write_json
from cb_serve.benchmarks.workload import Workload, make_workload


def timed_run(llm: LLM, workload: Workload) -> tuple[list[StepStats], Timer]:
    """The workload through ``llm.generate`` after a warmup; every step's stats and the run's timer."""
    warm_up(llm, workload)
    params = [greedy(n) for n in workload.output_lens]
    with recording_steps(llm) as steps, Timer() as timer:
        llm.generate(workload.prompts, params, use_tqdm=False)
    log(
        f"instrumented run: {workload.output_tokens} generated tokens in {timer.wall_s:.1f} s "
        f"({workload.output_tokens / timer.wall_s:.1f} tok/s), foreign CPU share {timer.foreign_cpu_share}"
    )
    return steps, timer


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, description=__doc__)
    log(f"profile_step, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}")
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    llm = LLM(**engine_kwargs(args))
    workload = make_workload(llm.engine.tokenizer, args.num_requests, args.seed)
    log(f"workload: {json.dumps(workload.summary())}")

    steps, timer = timed_run(llm, workload)
    table = breakdown(steps)
    print_breakdown(table)
    outside = timer.wall_s - sum(s.duration_s for s in steps)
    where = "adding requests, LLM.generate's loop, step listeners"
    log(f"outside engine steps ({where}): {outside:.2f} s of {timer.wall_s:.1f} s")

    ops, op_kinds = op_profile(llm, make_workload(llm.engine.tokenizer, args.num_requests, args.seed + 1))
    out = {
        "command": " ".join(sys.argv),
        "cb_serve": cb_serve_source(),
        "workload": workload.summary(),
        "wall_s": timer.wall_s,
        **timer.to_json(),
        "outside_steps_s": outside,
        "breakdown": table,
        "ops": ops,
        "op_kinds": op_kinds,
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
