"""The mixture-of-experts expert kernels on one layer: cb-serve's C++ grouped GEMM (``CpuExpertGemm``) and its
PyTorch reference (``TorchExpertGemm``: one ``F.linear`` per expert) through the same ``fused_experts``, and HF
transformers' own expert loop (``Qwen3MoeExperts.forward``), at decode-sized and prefill-sized token counts.
Qwen3-MoE-shaped layer (default hidden 1024, 64 experts, top 8, expert width 256), float32, random weights and
routing from a random router. Also checks the C++ path against the reference (max abs difference).
``--weights bfloat16``: the weights rounded to bf16 (a bf16 checkpoint's, computed in float32), which the C++
path reads as bf16, and on AMX CPUs runs experts with 32 rows or more on the tiles.

    .venv/bin/python bench/moe_kernels.py --out bench/results/moe_kernels.json    # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cb_serve import cpu_ops
from cb_serve.benchmarks.report import log, run_info, write_json
from cb_serve.cpu_ops import cpu_model_and_flags
from cb_serve.model_executor.layers.fused_experts import CpuExpertGemm, TorchExpertGemm, fused_experts, route_pairs
from cb_serve.model_executor.layers.moe import MoESpec, activation_fn
from cb_serve.model_executor.layers.moe_router import RouterSpec, select_experts


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@torch.inference_mode()
def measure(tokens: int, hf, router: torch.Tensor, spec: MoESpec, repeats: int) -> dict:
    """One token count: HF's loop, the reference and the C++ kernel through ``fused_experts``."""
    e, h, inter = spec.router.num_experts, router.shape[1], spec.intermediate_size
    cpu, ref = CpuExpertGemm(), TorchExpertGemm()
    packed = (cpu.prepare(hf.gate_up_proj.data), cpu.prepare(hf.down_proj.data)) if cpu_ops.available() else None
    x = torch.randn(tokens, h)
    weights, ids = select_experts(x @ router.T, spec.router)

    def ours(gemm, w13, w2, use_cpu_ops):
        routing = route_pairs(weights, ids, range(e), e)
        return fused_experts(x, routing, gemm, w13, w2, (2 * inter, h), activation_fn(spec, use_cpu_ops))

    row = {"tokens": tokens, "active_experts": int(ids.unique().numel())}
    row["hf_loop_s"] = median_seconds(lambda: hf(x, ids, weights), repeats)
    row["torch_reference_s"] = median_seconds(lambda: ours(ref, hf.gate_up_proj, hf.down_proj, False), repeats)
    if packed is not None:
        row["cpp_grouped_gemm_s"] = median_seconds(lambda: ours(cpu, *packed, True), repeats)
        diff = ours(cpu, *packed, True) - ours(ref, hf.gate_up_proj, hf.down_proj, False)
        row["cpp_max_abs_diff"] = float(diff.abs().max())
        row["cpp_speedup_vs_torch"] = row["torch_reference_s"] / row["cpp_grouped_gemm_s"]
        row["cpp_speedup_vs_hf"] = row["hf_loop_s"] / row["cpp_grouped_gemm_s"]
        # each active expert's three projections read once: the weight bytes over the kernel's time
        size = packed[0].element_size()
        row["cpp_weight_gb_s"] = row["active_experts"] * 3 * h * inter * size / row["cpp_grouped_gemm_s"] / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--tokens", default="1,8,64,256,1024")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--weights", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    h, e, k, inter = args.hidden, args.experts, args.top_k, args.intermediate
    config = Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=inter)
    hf = Qwen3MoeExperts(config)
    with torch.no_grad():
        hf.gate_up_proj.normal_(0, 0.05)
        hf.down_proj.normal_(0, 0.05)
        if args.weights == "bfloat16":
            for w in (hf.gate_up_proj, hf.down_proj):
                w.copy_(w.bfloat16().float())
    router = torch.randn(e, h) * 0.05
    spec = MoESpec(RouterSpec(e, k, renormalize=True), inter)
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        rows.append(measure(tokens, hf, router, spec, args.repeats))
        log(" ".join(f"{key}={v:.4g}" if isinstance(v, float) else f"{key}={v}" for key, v in rows[-1].items()))
    model, _ = cpu_model_and_flags()
    log(f"CPU: {model}, {torch.get_num_threads()} threads")
    write_json(
        args.out,
        {**run_info(started), "cpu": model, "threads": torch.get_num_threads(), "shape": vars(args), "rows": rows},
    )


if __name__ == "__main__":
    main()
