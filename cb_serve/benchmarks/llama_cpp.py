"""llama.cpp's ``llama-server`` as a peer in the offline benchmark.

- **Build**: the llama.cpp that the llama-cpp-python sdist on PyPI vendors (``vendor/llama.cpp``, pinned by
  ``LLAMA_CPP_PYTHON_VERSION``), only the ``llama-server`` target, optimized for this CPU
  (``GGML_NATIVE``); cached under ``CACHE_ROOT/<version>-<hash of the CPU flags and CMake options>``
  so the next run reuses it. Any failure raises ``LlamaCppUnavailable`` with one line saying why.
- **Convert**: ``vendored_source`` is the llama.cpp tree a build came from; its ``convert_hf_to_gguf.py`` (with
  its ``gguf-py``) writes the GGUF of a HF directory for this build (``bench/moe_bench.py``).
- **Serve**: the same GGUF file as cb-serve, ``SERVER_SLOTS`` slots with continuous batching, the
  benchmark's torch threads, loopback only; the process is always stopped on the way out.
- **Client**: the workload's token-id prompts sent to ``/completion`` all at once, greedy, EOS ignored,
  no prompt cache, the generated token ids returned for comparison.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from cb_serve.benchmarks.cpu_accounting import Contention, Timer
from cb_serve.benchmarks.report import SystemResult, batch_invariance, log, make_result
from cb_serve.benchmarks.server_control import stop
from cb_serve.benchmarks.workload import Workload, warmup_prompt
from cb_serve.cpu_ops import cpu_model_and_flags

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cb_serve" / "llama.cpp"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: this CPU's AVX-512 / VNNI / AMX kernels, as cb-serve uses
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary in the cache
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",  # llama-server lives under tools/
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",  # loopback HTTP only
    "-DLLAMA_BUILD_UI=OFF",  # no web UI: nothing fetched at build time
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# GCC's _tile_loadconfig (12.2 here) declares that it reads 8 bytes of the 64-byte tile config, so the
# compiler drops the stores to the rest and ggml's AMX matmul faults on LDTILECFG (llama.cpp issue 20824,
# PR 26954). On AMX CPUs every C++ file of the build includes this first: the intrinsic with the whole
# config as its operand (correct with any compiler).
TILECFG_HEADER = "amx_tilecfg_fix.h"
TILECFG_FIX = """#pragma once
#include <immintrin.h>
#define _tile_loadconfig(config) __asm__ volatile("ldtilecfg %0" ::"m"(*(const unsigned char(*)[64])(config)))
"""
BUILD_TIMEOUT_S = 3600
SERVER_SLOTS = 16
CONTEXT_ALIGN = 256  # each slot's context, rounded up to this many tokens
READY_TIMEOUT_S = 120.0
PR_SET_PDEATHSIG = 1  # prctl option: the signal a child gets when its parent exits
REQUEST_TIMEOUT_S = 1800.0


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot run here; the message says why, in one line."""


@dataclass(frozen=True)
class LlamaServerBuild:
    """A built ``llama-server`` and what it was built from."""

    binary: str
    llama_cpp_python: str
    llama_cpp_commit: str  # the vendored llama.cpp commit, from the sdist's changelog ("unknown" if absent)
    cmake_options: tuple[str, ...]
    compiler: str
    build_s: float  # wall seconds of download, configure and build when it was built
    reused: bool = False  # found in the cache by this run

    def to_json(self) -> dict[str, Any]:
        """The fields, JSON-ready (what ``build.json`` in the cache holds, plus ``reused``)."""
        return {**asdict(self), "cmake_options": list(self.cmake_options)}


def build_key(version: str, cpu_flags: set[str], options: Sequence[str]) -> str:
    """The cache directory's name: the version and a hash of the CPU's flags and the CMake options."""
    digest = hashlib.sha256(json.dumps([sorted(cpu_flags), list(options)]).encode()).hexdigest()[:12]
    return f"{version}-{digest}"


def vendored_commit(changelog: str, version: str) -> str:
    """The llama.cpp commit that llama-cpp-python ``version`` vendors, from its CHANGELOG's section."""
    section = re.search(rf"^## \[{re.escape(version)}\]$(.*?)(?=^## \[|\Z)", changelog, re.M | re.S)
    found = section and re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1))
    return found.group(1) if found else "unknown"


def cmake_options(directory: Path, cpu_flags: set[str]) -> tuple[str, ...]:
    """``CMAKE_OPTIONS``, plus on an AMX CPU the forced include of ``TILECFG_HEADER`` in ``directory``."""
    if "amx_tile" not in cpu_flags:
        return CMAKE_OPTIONS
    return (*CMAKE_OPTIONS, f"-DCMAKE_CXX_FLAGS=-include {directory / TILECFG_HEADER}")


def cmake_commands(source: Path, build: Path, options: Sequence[str], commit: str, jobs: int) -> list[list[str]]:
    """Configure (Ninja when installed) and build the ``llama-server`` target."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(source), "-B", str(build), *generator, *options]
    return [
        [*configure, f"-DLLAMA_BUILD_COMMIT={commit}"],
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
    ]


def ensure_llama_server(cache_root: Path = CACHE_ROOT, version: str = LLAMA_CPP_PYTHON_VERSION) -> LlamaServerBuild:
    """The cached ``llama-server`` for this CPU, else downloads the sdist and builds it (minutes)."""
    cpu_flags = cpu_model_and_flags()[1]
    directory = cache_root / build_key(version, cpu_flags, (*CMAKE_OPTIONS, TILECFG_FIX))
    stamp = directory / "build.json"
    if stamp.exists():
        try:
            built = LlamaServerBuild(**{**json.loads(stamp.read_text()), "reused": True})
            if Path(built.binary).is_file():
                return built
        except (OSError, ValueError, TypeError):
            pass  # unreadable or stale: build again
    missing = [tool for tool in ("cmake", "c++", "cc") if shutil.which(tool) is None]
    if missing:
        raise LlamaCppUnavailable(f"{', '.join(missing)} not found (needed to build llama-server)")
    start = time.perf_counter()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    source = _download_sdist(version, directory)
    commit = vendored_commit(_read_text(source / "CHANGELOG.md"), version)
    log(f"[llama.cpp] building llama-server {version} (llama.cpp {commit}) in {directory} (log: build.log)")
    (directory / TILECFG_HEADER).write_text(TILECFG_FIX)
    options = cmake_options(directory, cpu_flags)
    vendored = source / "vendor" / "llama.cpp"
    for command in cmake_commands(vendored, directory / "build", options, commit, os.cpu_count() or 1):
        _run_logged(command, directory / "build.log")
    binary = directory / "build" / "bin" / "llama-server"
    if not binary.is_file():
        raise LlamaCppUnavailable(f"the build finished without {binary}")
    built = LlamaServerBuild(str(binary), version, commit, options, _compiler(), time.perf_counter() - start)
    stamp.write_text(json.dumps({k: v for k, v in built.to_json().items() if k != "reused"}, indent=2))
    return built


def vendored_source(build: LlamaServerBuild) -> Path:
    """The llama.cpp source tree ``build`` was built from (the sdist's ``vendor/llama.cpp``, kept beside the
    build in the cache): its ``convert_hf_to_gguf.py`` and ``gguf-py`` write GGUF files this build reads."""
    directory = Path(build.binary).parents[2]  # <cache>/<key>/build/bin/llama-server
    source = directory / f"llama_cpp_python-{build.llama_cpp_python}" / "vendor" / "llama.cpp"
    if not (source / "convert_hf_to_gguf.py").is_file():
        raise LlamaCppUnavailable(f"no llama.cpp source with convert_hf_to_gguf.py in {source}")
    return source


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _download_sdist(version: str, directory: Path) -> Path:
    """``pip download`` of the llama-cpp-python sdist into ``directory``, extracted; its root."""
    command = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps"]
    _run_logged([*command, "--no-binary", ":all:", "-d", str(directory)], directory / "download.log")
    archives = sorted(directory.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise LlamaCppUnavailable(f"pip download left no llama_cpp_python sdist in {directory}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(directory, filter="data")
    archives[0].unlink()  # extracted: only the build is kept
    root = directory / archives[0].name.removesuffix(".tar.gz")
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        raise LlamaCppUnavailable(f"{archives[0].name} vendors no llama.cpp")
    return root


def _run_logged(command: list[str], log_path: Path) -> None:
    """Runs ``command`` with its output appended to ``log_path``; a failure raises ``LlamaCppUnavailable``
    with the command's last output line."""
    with open(log_path, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LlamaCppUnavailable(f"`{command[0]} {command[1]}` failed: {type(e).__name__}: {e}") from e
    if done.returncode != 0:
        lines = [line for line in _read_text(log_path).splitlines() if line.strip()]
        last = lines[-1].strip() if lines else ""
        raise LlamaCppUnavailable(f"`{' '.join(command[:3])}` exited with {done.returncode}: {last} (see {log_path})")


def _compiler() -> str:
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


# ---- the server -----------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slot_context(workload: Workload) -> int:
    """Tokens each slot needs: the longest prompt plus its output, rounded up to ``CONTEXT_ALIGN``."""
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    return -(-(longest + 1) // CONTEXT_ALIGN) * CONTEXT_ALIGN


def server_command(binary: str, gguf: str, port: int, slots: int, context: int, threads: int) -> list[str]:
    """``llama-server`` on ``gguf`` with ``slots`` continuously batched slots sharing ``context`` tokens
    (``context / slots`` each), ``threads`` for decode and prompt batches, loopback only, no web UI and
    no host-memory prompt cache."""
    return [
        binary,
        *("-m", gguf, "--host", "127.0.0.1", "--port", str(port)),
        *("-np", str(slots), "-c", str(context), "--cont-batching"),
        *("-t", str(threads), "-tb", str(threads)),
        *("--no-webui", "--cache-ram", "0"),
    ]


def wait_until_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Polls ``/health`` until it answers 200 (the model is loaded); raises if the process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LlamaCppUnavailable(f"llama-server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise LlamaCppUnavailable(f"llama-server was not ready within {timeout_s:.0f} s")


@contextmanager
def running_server(command: list[str], log_path: Path) -> Iterator[str]:
    """Starts ``command`` (a ``server_command``) as a child in its own process group, output to ``log_path``;
    yields its base URL once healthy; always stops it (server_control.stop: SIGINT, SIGTERM, then SIGKILL)."""
    port = command[command.index("--port") + 1]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_healthy(base_url, proc)
        yield base_url
    finally:
        stop(proc, wait_for_tree_s=10.0)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the benchmark dies, even killed without cleanup."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


# ---- the client -----------------------------------------------------------------------------------------------
def completion_body(prompt: Sequence[int], n_predict: int) -> dict[str, Any]:
    """A ``/completion`` request: token-id prompt, greedy, exactly ``n_predict`` tokens (EOS ignored), no
    prompt cache, the generated token ids returned."""
    return {
        "prompt": list(prompt),
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def parse_completion(body: dict[str, Any], n_predict: int) -> list[int]:
    """The generated token ids of a ``/completion`` response; raises unless there are exactly ``n_predict``."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise RuntimeError(f"llama.cpp: no token ids in the response (keys: {sorted(body)})")
    if len(tokens) != n_predict or body.get("tokens_predicted", n_predict) != n_predict:
        raise RuntimeError(
            f"llama.cpp: {len(tokens)} tokens ({body.get('tokens_predicted')} predicted, stop type "
            f"{body.get('stop_type')!r}, truncated {body.get('truncated')}), {n_predict} requested"
        )
    return tokens


async def _complete(
    client: httpx.AsyncClient, url: str, prompt: Sequence[int], n: int, gate: asyncio.Semaphore
) -> list[int]:
    async with gate:
        response = await client.post(url, json=completion_body(prompt, n))
    if response.status_code != 200:
        raise RuntimeError(f"llama.cpp: HTTP {response.status_code}: {response.text[:200]}")
    return parse_completion(response.json(), n)


async def _complete_all(
    base_url: str, prompts: Sequence[Sequence[int]], output_lens: Sequence[int], concurrency: int
) -> list[list[int]]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        url = f"{base_url}/completion"
        return list(await asyncio.gather(*(_complete(client, url, p, n, gate) for p, n in zip(prompts, output_lens))))


def complete_all(
    base_url: str, prompts: Sequence[Sequence[int]], output_lens: Sequence[int], concurrency: int
) -> list[list[int]]:
    """Each prompt's generated token ids, with up to ``concurrency`` requests in flight at once."""
    return asyncio.run(_complete_all(base_url, prompts, output_lens, concurrency))


def same_tokenization(base_url: str, tokenizer: Any, prompts: Sequence[Sequence[int]]) -> float:
    """Share of ``prompts`` whose text (decoded by ``tokenizer``) llama-server's ``/tokenize`` splits into
    the same ids as ``tokenizer``: the token ids both sides exchange mean the same text."""
    same = 0
    for prompt in prompts:
        text = tokenizer.decode(list(prompt))
        ours = tokenizer(text, add_special_tokens=False)["input_ids"]
        response = httpx.post(f"{base_url}/tokenize", json={"content": text, "add_special": False}, timeout=60)
        same += response.status_code == 200 and response.json().get("tokens") == ours
    return same / max(len(prompts), 1)


def build_info(base_url: str) -> str | None:
    """The running server's ``build_info`` (``/props``), or None."""
    try:
        return httpx.get(f"{base_url}/props", timeout=10).json().get("build_info")
    except (httpx.HTTPError, ValueError):
        return None


def run_llama_cpp(
    gguf: str, workload: Workload, tokenizer: Any, threads: int, invariance_requests: int, log_path: Path
) -> SystemResult:
    """``workload`` through llama-server (built or reused) on ``gguf``: an untimed warmup request, then every
    request at once (timed from the first sent to the last answered), then the first ``invariance_requests``
    again one at a time (``batch_invariance``). Raises ``LlamaCppUnavailable`` when it cannot run here."""
    build = ensure_llama_server()
    context = SERVER_SLOTS * slot_context(workload)
    command = server_command(build.binary, gguf, free_port(), SERVER_SLOTS, context, threads)
    how = "reusing" if build.reused else "built"
    log(f"[llama.cpp] {how} {build.binary}; serving {Path(gguf).name} (log: {log_path})")
    with running_server(command, log_path) as base_url:
        complete_all(base_url, [warmup_prompt(workload)], [2], 1)
        with Contention([os.getpid()]) as contention, Timer() as timer:  # ours: this process and the server
            outputs = complete_all(base_url, workload.prompts, workload.output_lens, workload.num_requests)
        k = min(invariance_requests, workload.num_requests)
        sequential = complete_all(base_url, workload.prompts[:k], workload.output_lens[:k], 1)
        tokenization = same_tokenization(base_url, tokenizer, workload.prompts[:k])
        info = build_info(base_url)
    result = make_result(
        "llama.cpp",
        timer,
        workload,
        outputs,
        timed="first request sent..last response (HTTP over loopback, server warmed up)",
        slots=SERVER_SLOTS,
        context_tokens=context,
        server_threads=threads,
        server_args=" ".join(command[1:]),
        build_info=info,
        build=build.to_json(),
        same_tokenization=tokenization,
        batch_invariance=batch_invariance(outputs[:k], sequential),
    )
    result.extra["foreign_cpu_share"] = contention.foreign_cpu_share  # the server's CPU is not foreign
    return result
