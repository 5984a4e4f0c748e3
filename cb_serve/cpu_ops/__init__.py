"""C++ CPU kernels (``csrc/``), compiled on first use with torch's JIT extension builder and
cached under ``$TORCH_EXTENSIONS_DIR/cb_serve`` (default ``~/.cache/torch_extensions``); ``available()``
is False without a working C++ toolchain (or with ``CB_SERVE_CPU_OPS=0``), and callers then keep
their PyTorch path. The ops are registered as ``torch.ops.cb_serve.*``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from cb_serve.cpu_ops.expert_ops import (  # noqa: F401 (re-exported)
    amx_grouped_gemm,
    exact_in_bf16,
    grouped_gemm,
    moe_combine,
    pack_expert_weight,
)
from cb_serve.cpu_ops.ops import (  # noqa: F401 (re-exported)
    amx_gemm,
    amx_pair_max,
    apply_token_bitmask,
    argmax_rows,
    bf16_gemm,
    decode_gemm,
    decode_gemm_isa,
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    int8_tile_max,
    lora_apply,
    pack_decode_weight,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv,
)
from cb_serve.cpu_ops.recurrent_ops import gated_delta_rule_decode, mamba2_decode  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -fopenmp: at::parallel_for is a header template that runs serially without it (torch uses OpenMP).
COMMON_FLAGS = ["-O3", "-march=native", "-fopenmp"]
EXTENSIONS = {
    # Reassociated reductions and vectorized exp for the attention kernel.
    "cb_serve_attention_ops": (
        "paged_attention.cpp",
        ["-ffast-math", "-fno-finite-math-only", "-mprefer-vector-width=512"],
    ),
    "cb_serve_prefill_ops": (
        "prefill_attention.cpp",
        ["-ffast-math", "-fno-finite-math-only", "-mprefer-vector-width=512"],
    ),
    # No FMA contraction: element-wise results equal eager PyTorch's bit for bit.
    "cb_serve_layer_ops": ("layer_ops.cpp", ["-ffp-contract=off"]),
    "cb_serve_recurrent_ops": ("recurrent_ops.cpp", ["-ffp-contract=off"]),
    "cb_serve_gemm_ops": ("decode_gemm.cpp", ["-mprefer-vector-width=512"]),
    "cb_serve_lora_ops": ("lora_ops.cpp", ["-mprefer-vector-width=512"]),
    # The greedy head's int16 first pass: its AVX512-VNNI body where -march=native has it, a stub elsewhere.
    "cb_serve_greedy_ops": ("greedy_head.cpp", ["-mprefer-vector-width=512"]),
}
# Optional, x86-64 Linux only: AMX tile GEMM (amx_available()) and its AVX512-BF16 port (bf16_available()).
AMX_EXTENSION = ("cb_serve_amx_ops", ("amx_gemm.cpp", "amx_experts.cpp"), ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"])
BF16_EXTENSION = (
    "cb_serve_bf16_ops",
    "bf16_gemm.cpp",
    ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512bf16", "-ffp-contract=off"],  # multiply, then add
)
# decode_gemm built for one instruction set on any x86-64 CPU (decode_gemm_variant): what a CPU without
# AVX-512 runs, testable here. Each: its compiler flags, and the /proc/cpuinfo flags its instructions need.
ISA_VARIANTS = {
    "avx2": (["-mno-avx512f"], frozenset({"avx", "avx2", "fma", "f16c"})),
    "scalar": (["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avx"], frozenset()),
}


def variant_extension(isa: str) -> str:
    return f"cb_serve_gemm_ops_{isa}"


# The /proc/cpuinfo flags each optional build's instructions need: a library built with -m<isa> may run
# them anywhere, even in its load-time initializers, so it is never loaded on a CPU without them.
REQUIRED_FLAGS = {
    AMX_EXTENSION[0]: frozenset({"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512_bf16"}),
    BF16_EXTENSION[0]: frozenset({"avx512f", "avx512dq", "avx512bw", "avx512_bf16"}),
    **{variant_extension(isa): needs for isa, (_, needs) in ISA_VARIANTS.items()},
}
STALE_LOCK_S = 300  # no build takes this long (a few seconds each)
BUILD_ERROR: list[str] = []  # why the last build failed, for tests and logs
OPS = (
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "apply_token_bitmask",
    "argmax_rows",
    "moe_combine",
    "pack_decode_weight",
    "decode_gemm",
    "grouped_gemm",
    "int8_tile_max",
    "lora_apply",
    "gated_delta_rule_decode",
    "mamba2_decode",
)


def build_directory(name: str, source: str | tuple[str, ...], flags: list[str]) -> Path:
    """A build directory per content (sources, headers, flags, torch version) and CPU (``-march=native``
    builds for this one: a home directory that outlives a change of CPU must not load another's build),
    holding its own copy of the sources: checkouts at different paths then share one build instead of
    rebuilding (ninja rebuilds whenever a source path changes; ``build`` loads a finished build without it)."""
    files = sorted(CSRC.glob("*.h")) + [CSRC / s for s in sources(source)]
    model, cpu_flags = cpu_model_and_flags()
    python = sys.version_info[:2]
    digest = hashlib.sha256(repr((flags, torch.__version__, python, model, sorted(cpu_flags))).encode())
    for path in files:
        digest.update(path.read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    directory = root / "cb_serve" / f"{name}-{digest.hexdigest()[:16]}"
    (directory / "src").mkdir(parents=True, exist_ok=True)
    for path in files:
        target = directory / "src" / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            shutil.copyfile(path, target)
    lock = directory / "lock"  # torch's build lock; a build killed midway leaves it, and torch waits forever
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    return directory


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """The CPU's model name with its family and model numbers (a virtual machine's name, "AMD EPYC", says
    neither Zen 3 nor Zen 5) and its feature flags (Linux ``/proc/cpuinfo``; "unknown" and none elsewhere)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']} model {fields['model']})"
    return model, frozenset(fields.get("flags", "").split())


def missing_flags(name: str, cpu_flags: frozenset[str]) -> frozenset[str]:
    """The CPU features the optional build ``name`` needs and ``cpu_flags`` lacks (pure)."""
    return REQUIRED_FLAGS.get(name, frozenset()) - cpu_flags


def sources(source: str | tuple[str, ...]) -> tuple[str, ...]:
    return (source,) if isinstance(source, str) else source


def build(name: str, source: str | tuple[str, ...], flags: list[str]) -> None:
    """Builds (or loads the cached build of) one extension into this process; refuses (RuntimeError) an
    optional build whose instructions this CPU lacks."""
    from torch.utils.cpp_extension import load

    missing = missing_flags(name, cpu_model_and_flags()[1])
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(sorted(missing))}")

    directory = build_directory(name, source, COMMON_FLAGS + flags)
    library, built = directory / f"{name}.so", directory / "built"
    if built.is_file() and library.is_file():
        # This content's finished build, made from any checkout or environment: loaded as is. Through ninja
        # (torch's ``load``) a new virtual environment would rebuild it: its build line names torch's headers by
        # that environment's path.
        torch.ops.load_library(str(library))
        return
    load(
        name=name,
        sources=[str(directory / "src" / s) for s in sources(source)],
        extra_cflags=COMMON_FLAGS + flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    built.touch()  # after a load that succeeded: a build killed midway never counts as finished


@functools.cache
def available() -> bool:
    """Builds (or loads the cached builds of) the kernels, once per process: the extensions at once, one
    compiler per core (each is one source file: built in turn, a fresh build takes their sum)."""
    if os.environ.get("CB_SERVE_CPU_OPS", "1") == "0":
        logger.warning("cb_serve CPU kernels disabled (CB_SERVE_CPU_OPS=0); using the PyTorch path.")
        return False
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        flags = sys.getdlopenflags()  # each load sets and restores them: threads may interleave that
        try:
            with concurrent.futures.ThreadPoolExecutor(max(1, min(len(EXTENSIONS), cores))) as pool:
                list(pool.map(lambda item: build(item[0], *item[1]), EXTENSIONS.items()))  # raises the first failure
        finally:
            sys.setdlopenflags(flags)
        return all(hasattr(torch.ops.cb_serve, op) for op in OPS)
    except Exception as e:  # no compiler or ninja, unsupported platform
        BUILD_ERROR.append(str(e))
        logger.warning("cb_serve CPU kernels unavailable (%s); using the PyTorch path.", e)
        return False


@functools.cache
def amx_available() -> bool:
    """``amx_gemm`` runs here: an x86-64 Linux CPU with AMX-BF16, a compiler that targets it, and the
    kernel granting this process the tile state; ``CB_SERVE_AMX=0`` turns it off."""
    if os.environ.get("CB_SERVE_AMX", "1") == "0" or not available():
        return False
    if not _x86_64_linux():
        return False
    try:
        build(*AMX_EXTENSION)
        return bool(torch.ops.cb_serve.amx_init())
    except Exception as e:  # a compiler without AMX support
        BUILD_ERROR.append(str(e))
        logger.info("AMX GEMM unavailable (%s).", e)
        return False


def _x86_64_linux() -> bool:
    return sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def bf16_available() -> bool:
    """``bf16_gemm`` runs here: an x86-64 Linux CPU with AVX512-BF16 and a compiler that targets it;
    ``CB_SERVE_BF16_GEMM=0`` turns it off."""
    if os.environ.get("CB_SERVE_BF16_GEMM", "1") == "0" or not available() or not _x86_64_linux():
        return False
    try:
        build(*BF16_EXTENSION)
        return bool(torch.ops.cb_serve.bf16_gemm_supported())
    except Exception as e:  # a compiler without AVX512-BF16 support
        BUILD_ERROR.append(str(e))
        logger.info("AVX512-BF16 GEMM unavailable (%s).", e)
        return False


@functools.cache
def decode_gemm_variant(isa: str) -> bool:
    """Builds ``decode_gemm_<isa>`` (``ISA_VARIANTS``: the kernel compiled for that instruction set
    only); False off x86-64 Linux or where it does not build."""
    if not available() or not _x86_64_linux():
        return False
    try:
        compiler_flags, _ = ISA_VARIANTS[isa]
        build(variant_extension(isa), "decode_gemm.cpp", [*compiler_flags, f"-DCB_SERVE_ISA_VARIANT={isa}"])
        return hasattr(torch.ops.cb_serve, f"decode_gemm_{isa}")
    except Exception as e:
        BUILD_ERROR.append(str(e))
        logger.info("decode_gemm for %s unavailable (%s).", isa, e)
        return False


@functools.cache
def int8_tile_max_available() -> bool:
    """``int8_tile_max`` runs here: the C++ kernels built for a CPU with AVX512-VNNI."""
    return available() and bool(torch.ops.cb_serve.int8_tile_max_supported())
