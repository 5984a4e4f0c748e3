"""Tensor parallelism on CPU (issue 24, acceptance 4): ``tensor_parallel_size=2`` against one rank, the
built-in model (SmolLM2-135M-Instruct) through ``LLM.generate``, one process tree, one workload. A capability
check, not a speed-up: on one CPU the ranks share the same cores and memory bandwidth, and each step adds
2 all-reduces per layer plus one for the embedding and an all-gather of the logits (gloo over loopback TCP),
so TP=2 cannot beat one rank holding every core. On GPUs the same code splits the weight traffic over
separate HBM stacks; that is the figure to record when a device is lent (bench/RESULTS.md, GPU plan).

Workload: ``cb_serve.benchmarks.workload`` (seeded real-text prompts), ``--num-requests`` (32) requests,
greedy, ``ignore_eos``, all submitted at once. Configurations, each after an untimed warm-up:

  tp1-all-cores   one rank, torch threads = all cores
  tp1-one-core    one rank, one thread (what each TP=2 rank gets)
  tp2             two ranks (the driver and one spawned worker), one thread each

Reported per configuration: wall time, output tokens/s, decode-only step time (p50), and the foreign CPU
share (processes outside this benchmark's tree, the worker included as ours). Also: one gloo all-reduce
of a decode step's hidden state (``--batch`` rows x hidden size, float32) between two processes, timed
over 2000 rounds, and the collectives per step, so the step-time difference can be read against it.
The greedy outputs of every configuration must be equal (exit 1 if not).

Run from the repository root on an otherwise idle machine (~3 min on 2 cores):
    .venv/bin/python bench/tp_bench.py --out bench/results/tp_bench.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from cb_serve import LLM, SamplingParams
from cb_serve.benchmarks.cpu_accounting import Contention
from cb_serve.benchmarks.report import log, run_info, write_json
from cb_serve.benchmarks.workload import make_workload
from cb_serve.cpu_ops import cpu_model_and_flags

ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024)


def run(name: str, tp: int, threads: int, workload, max_tokens: int) -> dict:
    torch.set_num_threads(threads)  # the driver's (and one rank's) threads; workers get cores // tp
    llm = LLM(tensor_parallel_size=tp, num_threads=threads, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(workload.prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.engine.block_manager.reset_prefix_cache()
    steps = []
    llm.engine.add_step_listener(lambda stats, _outs: steps.append(stats))
    with Contention([os.getpid()]) as contention:
        start = time.perf_counter()
        outs = llm.generate(workload.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    llm.engine.shutdown()
    decode = [s.duration_s for s in steps if not s.num_prefill_tokens]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "name": name,
        "tensor_parallel_size": tp,
        "threads_per_rank": threads,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "decode_steps": len(decode),
        "decode_step_p50_ms": 1e3 * statistics.median(decode),
        "foreign_cpu_share": contention.foreign_cpu_share,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    log(
        f"{name:15s} {wall:6.2f} s  {tokens / wall:7.1f} tok/s  decode step p50 {result['decode_step_p50_ms']:6.2f} ms"
        f"  foreign {contention.foreign_cpu_share}"
    )
    return result


def _allreduce_peer(port: int, rows: int, hidden: int, rounds: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False)
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
    x = torch.ones(rows, hidden)
    for _ in range(rounds + 10):
        pg.allreduce([x]).wait()


def allreduce_latency(rows: int, hidden: int, rounds: int = 2000) -> float:
    """Median seconds of one gloo all-reduce of a ``rows x hidden`` float32 tensor between two processes."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    peer = multiprocessing.get_context("spawn").Process(target=_allreduce_peer, args=(store.port, rows, hidden, rounds))
    peer.start()
    pg = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=60))
    x = torch.ones(rows, hidden)
    times = []
    for i in range(rounds + 10):
        start = time.perf_counter()
        pg.allreduce([x]).wait()
        if i >= 10:
            times.append(time.perf_counter() - start)
    peer.join()
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="rows of the timed all-reduce")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cores = os.cpu_count() or 1
    model, flags = cpu_model_and_flags()
    log(f"CPU: {model} ({cores} cores, AMX: {'amx_tile' in flags})")
    llm = LLM(**ENGINE)
    workload = make_workload(llm.get_tokenizer(), args.num_requests, seed=0)
    hidden, layers = llm.engine.hf_config.hidden_size, llm.engine.hf_config.num_hidden_layers
    del llm
    results = [
        run("tp1-all-cores", 1, cores, workload, args.max_tokens),
        run("tp1-one-core", 1, 1, workload, args.max_tokens),
        run("tp2", 2, max(1, cores // 2), workload, args.max_tokens),
    ]
    latency = allreduce_latency(args.batch, hidden)
    collectives = 2 * layers + 1  # o_proj and down_proj per layer, the embedding; plus the logits all-gather
    log(f"gloo all-reduce of {args.batch} x {hidden} float32: {1e6 * latency:.1f} us; {collectives} per step")
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    log(f"greedy outputs equal across configurations: {same}")
    out = {
        **run_info(started),
        "cpu": {"model": model, "cores": cores, "amx": "amx_tile" in flags, "avx512f": "avx512f" in flags},
        "workload": workload.summary(),
        "engine": ENGINE,
        "max_tokens": args.max_tokens,
        "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
        "allreduce_rows": args.batch,
        "allreduce_median_us": 1e6 * latency,
        "collectives_per_step": collectives,
        "allreduce_ms_per_step": 1e3 * latency * collectives,
        "outputs_equal": same,
    }
    write_json(args.out, out)
    print(json.dumps(out["results"], indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
