"""Microbenchmarks of the two C++ decode kernels on the default model's shapes, 2 threads.

  gemm       ``cpu_ops.decode_gemm`` over all 30 layers' projections + the LM head, with distinct
             random weights per layer (so they stream from DRAM as in a decode step), per row count;
             ``--weights fp32`` (float32 tiles) or ``--weights exact`` (4-bit projections, 8-bit LM
             head: the layout the Q4_1 / Q8_0 GGUF default model gets); ``--weights amx``: the same
             weights on ``cpu_ops.amx_gemm`` (AMX tiles) instead.
  attention  ``cpu_ops.paged_decode_attention`` over 30 layers' KV caches: ``--seqs`` sequences with
             contexts uniform in [40, 700), blocks shuffled through the cache; ``--hot`` makes every
             sequence read the same 4 blocks (KV hot in cache: the arithmetic floor).
  head       ``cpu_ops.int8_tile_max`` (the greedy head's first pass without AMX) over Gemma 3's LM head
             (262144 x 640, 8-bit groups), per row count, against the AVX512-VNNI instruction peak.

Run from the repository root on an otherwise idle machine:
    .venv/bin/python bench/micro_kernels.py gemm --weights exact --rows 4 8 34 64
    .venv/bin/python bench/micro_kernels.py gemm --weights amx --rows 16 34 64
    .venv/bin/python bench/micro_kernels.py attention --seqs 34
    .venv/bin/python bench/micro_kernels.py head --rows 8 33 64
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PROJECTIONS = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # (out, in)


def median_seconds(fn: Callable[[], None], reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def exact_weight(n: int, k: int, bits: int, g: torch.Generator) -> torch.Tensor:
    """A float32 weight with Q4_1 (bits=4) or Q8_0 (bits=8) structure: group min at q=0 and max at q=15,
    or largest magnitude at q=127, as the GGUF quantizers produce."""
    groups = k // exact_quant.GROUP
    if bits == 4:
        d = (torch.rand(n, groups, 1, generator=g) * 0.01).half().float()
        q = torch.randint(0, 16, (n, groups, exact_quant.GROUP), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        return (d * q + (-8 * d).half().float()).view(n, k)
    d = (torch.rand(n, groups, 1, generator=g) * 0.001).half().float()
    q = torch.randint(-127, 128, (n, groups, exact_quant.GROUP), generator=g).float()
    q[..., 0] = 127
    return (d * q).view(n, k)


Gemm = Callable[[torch.Tensor], torch.Tensor]


def pack(weight: torch.Tensor, kind: str) -> Gemm:
    """``x -> x @ weight.T`` on the kernel and layout ``kind`` names."""
    n = weight.shape[0]
    if kind == "fp32":
        packed = cpu_ops.pack_decode_weight(weight)
        return lambda x: cpu_ops.decode_gemm(x, packed, n, None)
    groups = exact_quant.find_quant_groups(weight)
    assert groups is not None
    if kind == "amx":
        amx = exact_quant.pack_amx_weight(groups)
        return lambda x: cpu_ops.amx_gemm(x, amx, n, None)
    packed = exact_quant.pack_decode_weight_quantized(groups)
    return lambda x: cpu_ops.decode_gemm(x, packed, n, None)


def gemm_step(layers: list[list[Gemm]], head: Gemm, x: torch.Tensor, x_wide: torch.Tensor) -> None:
    for layer in layers:
        for (_, k), gemm in zip(PROJECTIONS, layer):
            gemm(x_wide if k == INTERMEDIATE else x)
    head(x)


def bench_gemm(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(0)
    if args.weights == "amx" and not cpu_ops.amx_available():
        raise SystemExit("no AMX here")

    def weight(n: int, k: int, bits: int) -> Gemm:
        w = exact_weight(n, k, bits, g) if args.weights != "fp32" else torch.randn(n, k, generator=g) * 0.02
        return pack(w, args.weights)

    layers = [[weight(n, k, 4) for n, k in PROJECTIONS] for _ in range(LAYERS)]
    head = weight(VOCAB, HIDDEN, 8)
    flop_per_row = 2 * (LAYERS * sum(n * k for n, k in PROJECTIONS) + VOCAB * HIDDEN)
    for rows in args.rows:
        step = functools.partial(gemm_step, layers, head, torch.randn(rows, HIDDEN), torch.randn(rows, INTERMEDIATE))
        seconds = median_seconds(step)
        print(f"rows={rows:3d}  {seconds * 1e3:6.1f} ms  {rows * flop_per_row / seconds / 1e9:6.1f} GFLOP/s")


def bench_attention(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(0)
    lens, _ = torch.randint(40, 700, (args.seqs,), generator=g, dtype=torch.int32).sort(descending=True)
    blocks_per_seq = [(int(n) + BLOCK - 1) // BLOCK for n in lens]
    num_blocks = sum(blocks_per_seq) + 8
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(args.seqs, max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for row, count in enumerate(blocks_per_seq):
        table[row, :count] = order[used : used + count]
        used += count
    if args.hot:
        table %= 4
    caches = [
        (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
        for _ in range(LAYERS)
    ]
    q = torch.randn(args.seqs, HEADS, HEAD_DIM)
    out = torch.empty_like(q)

    def step() -> None:
        for k_cache, v_cache in caches:
            cpu_ops.paged_decode_attention(out, q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5, None)

    seconds = median_seconds(step, reps=9)
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * 4 * LAYERS
    print(
        f"seqs={args.seqs} mean context {float(lens.float().mean()):.0f}{' (hot)' if args.hot else ''}: "
        f"{seconds * 1e3:.1f} ms  {kv_bytes / seconds / 1e9:.1f} GB/s of KV"
    )


def bench_head(args: argparse.Namespace) -> None:
    if not cpu_ops.int8_tile_max_available():
        raise SystemExit("int8_tile_max needs AVX512-VNNI")
    g = torch.Generator().manual_seed(0)
    vocab, hidden = 262144, 640
    tiles, groups = vocab // 32, hidden // 32
    packed = torch.randint(-127, 128, (tiles, groups, exact_quant.Q8_GROUP_BYTES), dtype=torch.int8, generator=g)
    scales = torch.rand(tiles, groups, 32, generator=g) * 0.01 + 0.001  # finite scales: no NaN arithmetic
    packed[:, :, :128] = scales.view(torch.int8).view(tiles, groups, 128)
    for rows in args.rows:
        xu = torch.randint(0, 256, (rows, groups, 32), dtype=torch.uint8, generator=g).view(torch.int32)
        xs = torch.rand(rows, groups, generator=g) * 0.01
        seconds = median_seconds(functools.partial(cpu_ops.int8_tile_max, xu, xs, packed, vocab))
        instructions = tiles * groups * (rows + 1) * 16  # vpdpbusd: 16 per row and group, 16 for the offsets
        print(f"rows={rows:3d}  {seconds * 1e3:6.1f} ms  {instructions / seconds / 1e9:5.2f} G vpdpbusd/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kernel", required=True)
    gemm = sub.add_parser("gemm")
    gemm.add_argument("--weights", choices=["fp32", "exact", "amx"], default="fp32")
    gemm.add_argument("--rows", type=int, nargs="+", default=[4, 8, 12, 16, 24, 34, 48, 64])
    attention = sub.add_parser("attention")
    attention.add_argument("--seqs", type=int, default=34)
    attention.add_argument("--hot", action="store_true")
    head = sub.add_parser("head")
    head.add_argument("--rows", type=int, nargs="+", default=[8, 16, 33, 64])
    args = parser.parse_args()
    torch.set_num_threads(2)
    if not cpu_ops.available():
        raise SystemExit(f"the C++ kernels did not build: {cpu_ops.BUILD_ERROR}")
    {"gemm": bench_gemm, "attention": bench_attention, "head": bench_head}[args.kernel](args)


if __name__ == "__main__":
    main()
