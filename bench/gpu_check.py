"""The GPU check's measurements (run by ``bench/gpu_check.sh`` after the gpu tests), on one CUDA
device, offline, with random-weight models built on the GPU from transformers configs:

1. greedy equality against HF ``generate`` on the GPU, a SmolLM2-shaped model (Triton attention, CUDA
   graphs): float32 against HF float32; bfloat16 against HF bfloat16, and against HF float32 beside HF's
   own bfloat16 run (two bfloat16 implementations round differently: the fair question is whether ours
   strays from the float32 picks more than HF's does); graphs on against off in bfloat16. Tie rule:
   where the reference's top two log-probabilities at a step are within ``TIE[dtype]``, the picks may
   differ and the comparison of that request stops there (float32: reduction order; bfloat16: its
   8-bit mantissa);
2. a 1B Llama (Llama-3.2-1B shapes) in bfloat16, KV cache sized from device memory: start-up time,
   TTFT of a 2k-token prompt (the first request, then a warm one), decode tok/s and the fraction of
   the HBM-bandwidth bound at batch 1, 16, 64 and 256 with graphs, and at 16 and 64 without; for each
   ``generate()`` its steps' sum against its wall time (the gap no step explains), its longest step, the
   decode steps' host phases, and the Triton kernels compiled meanwhile (0 after start-up);
3. the peak memory of sampled steps (top-p at 256 rows, full prefill budget) against
   ``activation_bytes``, the KV-sizing estimate;
4. a tiny model's engine sized from device memory (millions of KV blocks): start-up time and host memory.

    python3 bench/gpu_check.py --json OUT.json       (``--quick``: fewer and shorter requests)
    python3 bench/gpu_check.py --smoke                 the script itself on the CPU, tiny models
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cb_offline import greedy, recording_steps  # noqa: E402
from gpu_bench import LLAMA_1B, TINY, kv_bytes_per_token, make_model, weight_bytes  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402
from step_phases import PHASES, phase_seconds, step_kind  # noqa: E402

from cb_serve import LLM, SamplingParams  # noqa: E402
from cb_serve.benchmarks.report import cb_serve_source, log, write_json  # noqa: E402
from cb_serve.config import EngineConfig  # noqa: E402
from cb_serve.engine.kv_cache_sizing import activation_bytes  # noqa: E402
from cb_serve.model_executor.jit_compiles import num_triton_compiles  # noqa: E402

SMOL_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    initializer_range=0.1,  # peaked logits: few ties
)
TIE = {torch.float32: 1e-3, torch.bfloat16: 0.1}
CUDA = torch.device("cuda")  # --smoke: the CPU
SHAPES = {"smol": SMOL_SHAPE, "1b": LLAMA_1B, "tiny": TINY}


def sync() -> None:
    if CUDA.type == "cuda":
        torch.cuda.synchronize()


def first_divergence(ours: list[int], ref: list[int], gaps: list[float], tie: float) -> tuple[str, int]:
    """(``same`` | ``tie`` | ``MISMATCH``, identical leading tokens): at the first differing pick it is a
    tie where the reference's top two log-probabilities there (``gaps``) are within ``tie``."""
    for t, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return ("tie" if gaps[t] < tie else "MISMATCH"), t
    return ("same" if len(ours) == len(ref) else "MISMATCH"), len(ours)


def compare(runs: list[list[int]], refs: list[tuple[list[int], list[float]]], tie: float) -> dict[str, Any]:
    verdicts = [first_divergence(ours, ref, gaps, tie) for ours, (ref, gaps) in zip(runs, refs)]
    counts: dict[str, Any] = {v: sum(1 for x, _ in verdicts if x == v) for v in ("same", "tie", "MISMATCH")}
    counts["identical_prefix"] = round(
        statistics.fmean(t / max(1, len(r)) for (_, t), (r, _) in zip(verdicts, refs)), 3
    )
    return counts


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int, dtype: torch.dtype) -> list[tuple[list, list]]:
    """HF ``generate``'s greedy tokens and the top-two gap of its log-probabilities at each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(CUDA).eval()
    model.generation_config.eos_token_id = None  # as the engine's ignore_eos
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p], device=CUDA), max_new_tokens=n, do_sample=False,
                           output_scores=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
        top2 = torch.stack(g.scores)[:, 0].float().log_softmax(-1).topk(2).values.cpu()
        out.append((g.sequences[0, len(p) :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    del model
    return out


def ours_greedy(model_dir: Path, prompts: list[list[int]], n: int, **kwargs: Any) -> tuple[list, str]:
    """The engine's greedy tokens with the top-two gap at each step, and its attention backend."""
    llm = LLM(str(model_dir), **kwargs)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runs = []
    for o in outs:
        tops = [sorted((x.logprob for x in step.values()), reverse=True) for step in o.outputs[0].logprobs]
        runs.append((list(o.outputs[0].token_ids), [t[0] - t[1] for t in tops]))
    return runs, llm.engine.backend.name


def equality(tmp: Path, quick: bool) -> dict[str, Any]:
    """Ours against HF in float32; in bfloat16 against HF bfloat16 and, as HF's own bfloat16 run is,
    against HF float32 (the model's exact picks); graphs against eager in bfloat16."""
    torch.manual_seed(0)
    model_dir = make_model(tmp / "smol", SHAPES["smol"], torch.float32, CUDA)
    gen = torch.Generator().manual_seed(1)
    lens = [5, 17, 64, 300] if quick else [5, 9, 17, 40, 64, 130, 300, 700]
    prompts = [torch.randint(2, SHAPES["smol"]["vocab_size"], (n,), generator=gen).tolist() for n in lens]
    n = 16 if quick else 32
    args = dict(device=CUDA.type, max_model_len=1024, max_num_seqs=16, num_gpu_blocks=1024)
    hf32, hf16 = (hf_greedy(model_dir, prompts, n, dtype) for dtype in (torch.float32, torch.bfloat16))
    f32, backend = ours_greedy(model_dir, prompts, n, dtype="float32", **args)
    b16, _ = ours_greedy(model_dir, prompts, n, dtype="bfloat16", **args)
    eager, _ = ours_greedy(model_dir, prompts, n, dtype="bfloat16", enforce_eager=True, **args)
    tokens = lambda runs: [t for t, _ in runs]  # noqa: E731
    r: dict[str, Any] = {"backend": backend, "tie_float32": TIE[torch.float32], "tie_bfloat16": TIE[torch.bfloat16]}
    r["float32_vs_hf_float32"] = compare(tokens(f32), hf32, TIE[torch.float32])
    r["bfloat16_vs_hf_bfloat16"] = compare(tokens(b16), hf16, TIE[torch.bfloat16])
    r["bfloat16_vs_hf_float32"] = compare(tokens(b16), hf32, TIE[torch.bfloat16])
    r["hf_bfloat16_vs_hf_float32"] = compare(tokens(hf16), hf32, TIE[torch.bfloat16])
    r["bfloat16_graphs_vs_eager"] = compare(tokens(b16), eager, TIE[torch.bfloat16])
    # bfloat16 is judged by its own distance from float32: a deep random model amplifies each rounding
    # difference until picks part (HF's bfloat16 run strays from HF float32 within a few tokens), so
    # ours may part from HF bfloat16, and graphs from eager (other GEMM shapes), no more often.
    bound = r["hf_bfloat16_vs_hf_float32"]["MISMATCH"]
    r["ok"] = (
        r["float32_vs_hf_float32"]["MISMATCH"] == 0
        and r["bfloat16_vs_hf_bfloat16"]["MISMATCH"] <= bound
        and r["bfloat16_graphs_vs_eager"]["MISMATCH"] <= bound
    )
    return r


def decode_at(llm: LLM, batch: int, prompt_len: int, out_len: int, bandwidth: float) -> dict[str, Any]:
    """Median decode-only step at ``batch`` rows: tok/s and the bandwidth bound's fraction."""
    gen = torch.Generator().manual_seed(batch)
    vocab = SHAPES["1b"]["vocab_size"]
    prompts = [
        {"prompt_token_ids": torch.randint(2, vocab, (prompt_len,), generator=gen).tolist()} for _ in range(batch)
    ]
    compiles = num_triton_compiles()
    ends: list[float] = []  # when each step's outputs were made: under async scheduling steps overlap, so a

    def step_end(_stats: Any, _outputs: Any) -> None:  # step's share of the wall is the gap between two ends
        ends.append(time.perf_counter())

    llm.engine.add_step_listener(step_end)
    with recording_steps(llm) as steps:
        start = time.perf_counter()
        llm.generate(prompts, greedy(out_len), use_tqdm=False)
        wall = time.perf_counter() - start
    llm.engine.remove_step_listener(step_end)
    decodes = [i for i, s in enumerate(steps) if not s.num_prefill_tokens]
    rows = max(steps[i].num_seqs for i in decodes)  # batch, unless the KV cache could not hold them all
    full = [i for i in decodes if steps[i].num_seqs == rows and i > 0 and steps[i - 1].num_seqs == rows]
    step_s = statistics.median(ends[i] - ends[i - 1] for i in full)
    bound_s = (weight_bytes(llm) + kv_bytes_per_token(llm) * rows * (prompt_len + out_len / 2)) / (bandwidth * 1e9)
    replay_s = graph_replay_s(llm, rows)
    return {"rows": rows, "decode_tok_s": round(rows / step_s), "step_ms": round(step_s * 1e3, 3),
            "hbm_fraction": round(bound_s / step_s, 3), "generate_tok_s": round(batch * out_len / wall),
            "async_scheduling": llm.engine.async_scheduling,
            "graph_replay_ms": None if replay_s is None else round(replay_s * 1e3, 3),
            "gpu_idle_fraction": None if replay_s is None else round(max(0.0, 1 - replay_s / step_s), 3),
            **step_accounting(steps, [steps[i] for i in full], wall),
            "triton_compiles": num_triton_compiles() - compiles}  # fmt: skip


def graph_replay_s(llm: LLM, rows: int, reps: int = 50) -> float | None:
    """The decode graph of ``rows`` replayed back to back, timed by CUDA events: the device's own time per step
    (its buffers hold the last step's batch). None without graphs."""
    graphs = llm.engine.runner.graph_runner
    size = None if graphs is None else next((n for n in graphs.sizes if n >= rows), None)
    if CUDA.type != "cuda" or size is None or size not in graphs.graphs:
        return None
    graph = graphs.graphs[size]
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps


def step_accounting(steps: list, full: list, wall: float) -> dict[str, Any]:
    """Where one ``generate()``'s wall time went: its steps' sum against the wall (the gap: what no step
    explains, such as a live compile), the longest step and its kind, and the full-batch decode steps'
    host phases in µs per step (schedule, prepare, execute: launch to the sampled ids on the host,
    output)."""
    total = sum(s.duration_s for s in steps)
    longest = max(steps, key=lambda s: s.duration_s)
    phases = {p: round(1e6 * statistics.median(phase_seconds(s)[p] for s in full), 1) for p in PHASES}
    return {"sum_steps_s": round(total, 3), "wall_gap_s": round(wall - total, 3),
            "longest_step_ms": round(longest.duration_s * 1e3, 2), "longest_step_kind": step_kind(longest),
            "decode_phase_us": phases}  # fmt: skip


def ttft(llm: LLM, prompt_len: int, seed: int) -> float:
    prompt = torch.randint(2, SHAPES["1b"]["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(seed))
    sync()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt.tolist()}], greedy(1), use_tqdm=False)
    return round((time.perf_counter() - start) * 1e3, 1)


def llama_1b(tmp: Path, quick: bool) -> dict[str, Any]:
    bandwidth = copy_bandwidth(1 << 30, reps=10, device=CUDA, dtype=torch.bfloat16, warmup=2)
    model_dir = make_model(tmp / "llama1b", SHAPES["1b"], torch.bfloat16, CUDA)
    r: dict[str, Any] = {"hbm_copy_gb_s": round(bandwidth)}
    engine_args = dict(device=CUDA.type, dtype="bfloat16", max_model_len=2304, max_num_seqs=256)
    if CUDA.type == "cpu":  # the smoke run: the pipelined step too (on by default on CUDA only)
        engine_args.update(num_gpu_blocks=4096, async_scheduling=True)
    sync()
    start = time.perf_counter()
    llm = LLM(str(model_dir), **engine_args)
    r["startup_s"] = round(time.perf_counter() - start, 1)
    r["kv_blocks"], r["backend"] = llm.engine.num_blocks, llm.engine.backend.name
    r["ttft_2k_first_ms"], r["ttft_2k_warm_ms"] = ttft(llm, 2000, 1), ttft(llm, 2000, 2)
    out_len = 32 if quick else 64
    for batch in (1, 16, 64, 256):
        r[f"graphs_batch_{batch}"] = decode_at(llm, batch, 128, out_len, bandwidth)
    if llm.engine.async_scheduling:  # the same steps without the overlap (nothing is in flight between calls)
        llm.engine.async_scheduling = False
        for batch in (1, 256):
            r[f"graphs_sync_batch_{batch}"] = decode_at(llm, batch, 128, out_len, bandwidth)
        llm.engine.async_scheduling = True
    r["memory"] = peak_memory(llm, engine_args)
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    eager = LLM(str(model_dir), enforce_eager=True, **{"num_gpu_blocks": 8192, **engine_args})
    for batch in (16, 64):
        r[f"eager_batch_{batch}"] = decode_at(eager, batch, 128, out_len, bandwidth)
    return r


def peer(tmp: Path, quick: bool) -> dict[str, Any]:
    """Issue 51's workload, 256 requests of 512 random prompt tokens to 128 greedy tokens (EOS ignored; quick:
    64 x 256 -> 32), on the 1B Llama shape in bfloat16: cb-serve's ``generate`` against transformers'
    ``generate_batch`` (its continuous batching) in the same run, the same weights."""
    from transformers import AutoModelForCausalLM

    from cb_serve.benchmarks.hf_baseline import run_hf_continuous
    from cb_serve.benchmarks.workload import Workload

    n, prompt_len, out_len = (64, 256, 32) if quick else (256, 512, 128)
    if CUDA.type == "cpu":  # the smoke run: HF's CPU generate_batch is slow
        n, prompt_len, out_len = 8, 64, 8
    model_dir = tmp / "llama1b"
    if not model_dir.exists():  # made by the llama_1b stage when it ran
        make_model(model_dir, SHAPES["1b"], torch.bfloat16, CUDA)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, SHAPES["1b"]["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in range(n)]
    r: dict[str, Any] = {"workload": f"{n} x {prompt_len} -> {out_len}"}
    args = dict(device=CUDA.type, dtype="bfloat16", max_model_len=prompt_len + out_len, max_num_seqs=256)
    llm = LLM(str(model_dir), **args, **({"num_gpu_blocks": 4096} if CUDA.type == "cpu" else {}))
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy(4), use_tqdm=False)  # warm
    sync()
    start = time.perf_counter()
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(out_len), use_tqdm=False)
    sync()
    wall = time.perf_counter() - start
    r["cb_serve_tok_s"], r["cb_serve_s"] = round(n * out_len / wall), round(wall, 2)
    r["async_scheduling"] = llm.engine.async_scheduling
    ours_tokens = [o.outputs[0].token_ids for o in ours]
    llm.engine.shutdown()
    del llm, ours
    gc.collect()
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(CUDA)
    workload = Workload(prompts, [out_len] * n, corpus_tokens=0, digest="")
    theirs = run_hf_continuous(hf, workload, "generate_batch")
    r["hf_generate_batch_tok_s"], r["hf_generate_batch_s"] = round(theirs.generated_tok_s), round(theirs.wall_s, 2)
    r["ratio"] = round(r["cb_serve_tok_s"] / theirs.generated_tok_s, 2)
    r["same_first_token"] = sum(a[:1] == b[:1] for a, b in zip(ours_tokens, theirs.outputs)) / n  # bf16: ties differ
    del hf
    return r


def peak_memory(llm: LLM, engine_args: dict[str, Any]) -> dict[str, Any]:
    """A full-budget prefill and 256 rows sampled with top-p: the step's peak above what the engine
    holds between steps, against the estimate the KV cache was sized with."""
    from cb_serve.model_executor.loader import load_config

    if CUDA.type != "cuda":
        return {}
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(2, 32000, (64,), generator=gen).tolist()} for _ in range(256)]
    llm.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - held
    config = EngineConfig.from_kwargs(model=llm.engine.source.path, **engine_args)
    estimate = activation_bytes(load_config(llm.engine.source), config, 2)
    free, total = torch.cuda.mem_get_info()
    return {"step_peak_gib": round(peak / 2**30, 3), "estimate_gib": round(estimate / 2**30, 3),
            "peak_over_estimate": round(peak / estimate, 3), "device_free_gib": round(free / 2**30, 2),
            "device_total_gib": round(total / 2**30, 2)}  # fmt: skip


def many_blocks(tmp: Path) -> dict[str, Any]:
    import resource

    model_dir = make_model(tmp / "tiny", TINY, torch.bfloat16, CUDA)
    sized = {} if CUDA.type == "cuda" else {"num_gpu_blocks": 1 << 20}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    llm = LLM(str(model_dir), device=CUDA.type, dtype="bfloat16", max_model_len=256, enforce_eager=True, **sized)
    r = {"startup_s": round(time.perf_counter() - start, 1), "kv_blocks": llm.engine.num_blocks}
    r["host_max_rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) >> 10
    r["tokens"] = len(llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids)
    return r


def stage(out: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Runs one part; a failure is recorded and the next part still runs."""
    start = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - reported in the summary
        traceback.print_exc()
        out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    out[name]["seconds"] = round(time.perf_counter() - start, 1)
    log(f"[{name}] {out[name]}")
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    p.add_argument("--smoke", action="store_true", help="the script itself, on the CPU with tiny models")
    p.add_argument("--stages", default="equality,llama_1b,peer,many_blocks", help="which parts, comma-separated")
    args = p.parse_args(argv)
    import transformers
    import triton

    global CUDA
    if args.smoke:
        CUDA, args.quick = torch.device("cpu"), True
        SHAPES.update(smol=dict(TINY, vocab_size=1000), **{"1b": TINY})
    name = torch.cuda.get_device_name() if CUDA.type == "cuda" else "cpu (smoke run)"
    out: dict[str, Any] = {"source": cb_serve_source(), "device_name": name,
                           "torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        parts = {"equality": equality, "llama_1b": llama_1b, "peer": peer,
                 "many_blocks": lambda tmp, _quick: many_blocks(tmp)}  # fmt: skip
        for name in args.stages.split(","):
            stage(out, name, lambda fn=parts[name]: fn(Path(tmp), args.quick))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
