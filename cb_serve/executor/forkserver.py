"""Tensor-parallel worker processes forked from a warm server (``CB_SERVE_WORKER_MULTIPROC_METHOD=forkserver``,
CPU only), as vLLM's ``VLLM_WORKER_MULTIPROC_METHOD`` picks how its workers start.

A worker started as a fresh interpreter (``spawn``, the default) spends seconds importing torch,
transformers' config chain and the model code before it can join its driver. The fork server is one
fresh interpreter that imports all that once, single-threaded, and then ``os.fork``s a worker per
request: a later engine's workers start in milliseconds and share the imported pages. It pays where a
process builds many tensor-parallel engines (a test suite, a benchmark sweep); it costs one idle process
(a few hundred MiB) for as long as the driver's process lives.

Safety: the server never runs a torch op, so no OpenMP or BLAS pool exists to fork (OpenBLAS's own
thread is kept off with ``OPENBLAS_NUM_THREADS=1``), and it checks before each fork that it is the only
thread. A worker runs with the driver's environment and working directory of that moment; the server
is used only while the driver's environment is the one it started with (a module may read a variable
at import), and is replaced otherwise. Not on CUDA: a fork after importing the CUDA libraries is a path
the CPU machines cannot test."""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from cb_serve.executor.worker import WorkerHandle, WorkerSpec

logger = logging.getLogger(__name__)

METHOD_ENV = "CB_SERVE_WORKER_MULTIPROC_METHOD"
METHODS = ("spawn", "forkserver")
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)  # changes per test, read by nothing a worker imports


def multiproc_method(device_type: str) -> str:
    """How local worker processes start: ``forkserver`` where asked for and on the CPU, else ``spawn``."""
    method = os.environ.get(METHOD_ENV) or "spawn"
    if method not in METHODS:
        raise ValueError(f"{METHOD_ENV}={method!r}: expected one of {', '.join(METHODS)}")
    return method if device_type == "cpu" else "spawn"


def worker_env() -> dict[str, str]:
    """The driver's environment, with this package importable (a checkout that is not installed)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _fingerprint(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE_ENV}


class ForkedWorker(WorkerHandle):
    """A worker forked by the server: not this process's child, so it is watched through a pidfd."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # it has ended already (and the server reaped it)
            self.pidfd = None

    def is_alive(self) -> bool:
        return self.pidfd is not None and not select.select([self.pidfd], [], [], 0)[0]

    def stop(self) -> None:
        """After the driver said stop: waits for the process to end, then kills it."""
        if self.pidfd is None:
            return
        for wait_s in (10, 5):
            if select.select([self.pidfd], [], [], wait_s)[0]:
                break
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        os.close(self.pidfd)
        self.pidfd = None


class ForkServer:
    """The server process and the driver's end of its socket (one request at a time)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "cb_serve.executor", "--forkserver", str(theirs.fileno())]
        server_env = {**env, "OPENBLAS_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(command, env=server_env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.conn = Connection(ours.detach())
        logger.info("tensor-parallel workers fork from server process %d (%s=forkserver)", self.proc.pid, METHOD_ENV)
        self.lock = threading.Lock()

    def fork(self, spec: WorkerSpec, env: dict[str, str]) -> ForkedWorker:
        with self.lock:
            self.conn.send((spec, env, os.getcwd()))
            kind, value = self.conn.recv()
        if kind != "pid":
            raise RuntimeError(f"the worker fork server cannot fork: {value}")
        return ForkedWorker(value)

    def close(self) -> None:
        self.conn.close()  # the server ends on EOF; its workers go on until their drivers stop them
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def fork_workers(specs: list[WorkerSpec]) -> list[WorkerHandle]:
    """One forked worker per spec, from this process's server (started, or replaced when the
    environment changed or it died). Raises where the server cannot fork."""
    global _server
    env = worker_env()
    with _server_lock:
        if _server is not None and (_server.proc.poll() is not None or _fingerprint(_server.env) != _fingerprint(env)):
            _server.close()
            _server = None
        if _server is None:
            _server = ForkServer(env)
        server = _server
    try:
        return [server.fork(spec, env) for spec in specs]
    except (OSError, EOFError) as e:
        with _server_lock:  # the next engine starts a new one
            if _server is server:
                _server = None
        server.close()
        raise RuntimeError(f"the worker fork server is gone ({e}); its log is this process's standard error") from e


def _preload() -> None:
    """What every worker imports before it can join its driver (``worker.worker_main``)."""
    import torch  # noqa: F401
    from transformers import AutoConfig, LlamaConfig  # noqa: F401 - transformers' shared config chain

    import cb_serve.distributed.group  # noqa: F401
    import cb_serve.distributed.sharding  # noqa: F401
    import cb_serve.model_executor.cache_tensors  # noqa: F401
    import cb_serve.model_executor.device_context  # noqa: F401
    import cb_serve.model_executor.model_runner  # noqa: F401
    import cb_serve.model_executor.model_setup  # noqa: F401


def _single_threaded() -> bool:
    return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1


def serve_forks(fd: int) -> None:
    """The server's loop: a ``(spec, env, cwd)`` request gets ``("pid", pid)`` or ``("error", why)``."""
    from cb_serve.executor.worker import worker_main

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # ended workers are reaped by the kernel
    _preload()
    conn = Connection(fd)
    while True:
        try:
            spec, env, cwd = conn.recv()
        except EOFError:
            return
        if not _single_threaded():
            conn.send(("error", f"the server has {len(os.listdir('/proc/self/task'))} threads; forking is unsafe"))
            continue
        pid = os.fork()
        if pid:
            conn.send(("pid", pid))
            continue
        code = 0
        try:
            conn.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            worker_main(spec)
        except BaseException:  # noqa: BLE001 - printed; the driver sees the exit
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
