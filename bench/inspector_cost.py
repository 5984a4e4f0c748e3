"""What the batch inspector's recording costs (issue 15): the benchmark workload through the
offline engine with recording on, timing every recording call against the steps' wall time,
then the same workload with recording off and on, alternating, for throughput.

    .venv/bin/python bench/inspector_cost.py --num-requests 64 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import time
from typing import Any

from cb_offline import recording_steps, run_cb_serve

from cb_serve import LLM
from cb_serve.benchmarks.workload import make_workload
from cb_serve.engine.inspector import Inspector

RECORDING = ("on_arrival", "on_step", "on_finished_outside_step")


def timed_recording(inspector: Inspector, spent: list[float]) -> None:
    """Wraps the inspector's recording methods so their wall time adds up in ``spent[0]``."""
    for name in RECORDING:
        method = getattr(inspector, name)

        @functools.wraps(method)
        def timed(*args: Any, _method=method, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(inspector, name, timed)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        return f"{model}{' (AMX)' if 'amx_tile' in out else ' (no AMX)'}"
    except (OSError, StopIteration):
        return platform.processor()


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="Off/on throughput pairs (default 2).")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()

    llm = LLM(seed=args.seed)  # the built-in SmolLM2, engine defaults (recording on: inspector_steps 2000)
    workload = make_workload(llm.get_tokenizer(), args.num_requests, args.seed)
    engine = llm.engine
    inspector = engine.inspector
    assert inspector is not None
    spent = [0.0]
    timed_recording(inspector, spent)
    with recording_steps(llm) as steps:
        result = run_cb_serve(llm, workload)
    step_s = sum(s.duration_s for s in steps)
    recorded = {
        "steps": len(steps),
        "step_seconds": step_s,
        "recording_seconds": spent[0],
        "recording_share_of_step_time": spent[0] / step_s,
        "recording_us_per_step": 1e6 * spent[0] / len(steps),
        "mean_seqs_per_step": statistics.fmean(s.num_seqs for s in steps),
        "tok_per_s": result.generated_tok_s,
    }
    print(json.dumps(recorded, indent=2))

    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            engine.inspector = None if mode == "off" else inspector
            rates[mode].append(run_cb_serve(llm, workload).generated_tok_s)
            print(mode, f"{rates[mode][-1]:.1f} tok/s", flush=True)
    report = {
        "cpu": cpu_name(),
        "workload": workload.summary(),
        "recorded_run": recorded,
        "tok_per_s": rates,
        "on_over_off": statistics.median(rates["on"]) / statistics.median(rates["off"]),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
