"""Which GEMM kernels this CPU runs for exactly-low-bit weights, chosen once per process.

- ``decode_gemm`` (up to ``DECODE_MAX_ROWS`` rows) is compiled for the CPU (``-march=native``): AVX-512,
  AVX2/FMA or scalar, the same bits from each.
- From ``split_min_rows`` rows a split-bf16 kernel runs instead, where one is faster than the float32
  GEMM: ``amx`` (AMX tiles) wherever AMX is usable; ``avx512_bf16`` (VDPBF16PS, every partial sum exact)
  only where a short self-timing at a prefill shape finds it faster than the float32 GEMM (``mkl``), the
  verdict cached per CPU model under ``~/.cache/cb_serve``; else ``mkl`` (``F.linear``).

``CB_SERVE_GEMM=amx|avx512_bf16|mkl`` forces the choice (benchmarks: an AMX CPU measured as one without).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cb_serve import cpu_ops

logger = logging.getLogger(__name__)

AMX_MIN_ROWS = 13  # below this the tiles' fixed costs outweigh decode_gemm's (bench/micro_kernels.py gemm)
BF16_MIN_ROWS = 65  # above decode_gemm's rows: the bf16 kernel only competes with the float32 GEMM
SPLIT_KERNELS = ("amx", "avx512_bf16", "mkl")
TIMING_SHAPE = (512, 3072, 576)  # rows, out, in: a prefill chunk through SmolLM2's gate/up projection


@dataclass(frozen=True)
class KernelChoice:
    decode: str  # decode_gemm's instruction set: avx512, avx2 or scalar
    split: str  # one of SPLIT_KERNELS
    split_min_rows: int
    reason: str

    @property
    def label(self) -> str:
        """One short string for logs, ``/stats`` and the metric label."""
        return f"decode={self.decode},prefill={self.split}"


def decide(forced: str | None, amx: bool, bf16: bool, bf16_faster: bool | None) -> tuple[str, str]:
    """The split kernel and why, from what is usable here (pure: tested on any CPU)."""
    if forced:
        if forced not in SPLIT_KERNELS:
            raise ValueError(f"CB_SERVE_GEMM must be one of {', '.join(SPLIT_KERNELS)}, got {forced!r}")
        usable = {"amx": amx, "avx512_bf16": bf16, "mkl": True}[forced]
        if usable:
            return forced, "forced by CB_SERVE_GEMM"
        logger.warning("CB_SERVE_GEMM=%s is not usable on this CPU; choosing as usual.", forced)
    if amx:
        return "amx", "AMX-BF16 tiles"
    if bf16 and bf16_faster:
        return "avx512_bf16", "AVX512-BF16, faster than the float32 GEMM in the self-timing"
    if bf16:
        return "mkl", "AVX512-BF16 present but slower than the float32 GEMM in the self-timing"
    return "mkl", "no AMX or AVX512-BF16"


def _seconds(fn, reps: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def time_bf16_against_float32() -> dict[str, float]:
    """Seconds per call of ``bf16_gemm`` and ``F.linear`` at ``TIMING_SHAPE`` (random Q4_1-shaped groups)."""
    from cb_serve.cpu_ops import exact_quant

    rows, n, k = TIMING_SHAPE
    g = torch.Generator().manual_seed(0)
    d = torch.rand(n, k // 32, generator=g).half().float() / 64
    groups = exact_quant.QuantGroups(torch.randint(0, 16, (n, k), generator=g).to(torch.uint8), d, -8 * d)
    weight, packed = groups.dequantize(), exact_quant.pack_amx_weight(groups)
    x = torch.randn(rows, k, generator=g)
    return {
        "avx512_bf16": _seconds(lambda: cpu_ops.bf16_gemm(x, packed, n, None)),
        "mkl": _seconds(lambda: torch.nn.functional.linear(x, weight)),
    }


def _cached_bf16_timing() -> dict[str, float]:
    model, flags = cpu_ops.cpu_model_and_flags()
    key = hashlib.sha256(repr((model, sorted(flags), torch.get_num_threads())).encode()).hexdigest()[:16]
    path = Path(os.environ.get("CB_SERVE_CACHE_DIR") or Path.home() / ".cache" / "cb_serve") / f"gemm-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    timing = time_bf16_against_float32()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(timing))
    except OSError:
        pass
    return timing


@functools.cache
def kernel_choice() -> KernelChoice | None:
    """The kernels this process runs (None without the C++ kernels); logged once."""
    if not cpu_ops.available():
        return None
    forced = os.environ.get("CB_SERVE_GEMM") or None
    amx, bf16 = cpu_ops.amx_available(), cpu_ops.bf16_available()
    faster = None
    if bf16 and not amx and forced is None:
        timing = _cached_bf16_timing()
        faster = timing["avx512_bf16"] < timing["mkl"]
    split, reason = decide(forced, amx, bf16, faster)
    min_rows = {"amx": AMX_MIN_ROWS, "avx512_bf16": BF16_MIN_ROWS, "mkl": 0}[split]
    choice = KernelChoice(cpu_ops.decode_gemm_isa(), split, min_rows, reason)
    logger.info("CPU GEMM kernels on %s: %s (%s)", cpu_ops.cpu_model_and_flags()[0], choice.label, reason)
    return choice
