"""Tensor-parallel workers as local processes (``distributed_executor_backend: mp``)."""

from __future__ import annotations

import pickle
import subprocess
import sys

from cb_serve.executor.forkserver import fork_workers, multiproc_method, worker_env
from cb_serve.executor.worker import WorkerHandle, WorkerSpec


class WorkerProcess(WorkerHandle):
    """A worker rank as a fresh interpreter, ``python -m cb_serve.executor``, reading its
    ``WorkerSpec`` from its standard input. Neither forked (the driver's threads, OpenMP pool and
    CUDA state are not fork-safe) nor spawned by ``multiprocessing`` (whose children import the
    driver's ``__main__``: a user's script without an ``if __name__ == "__main__":`` guard would
    run again in every worker). It ends by itself when the driver goes away (its connection closes)."""

    def __init__(self, spec: WorkerSpec) -> None:
        command = [sys.executable, "-m", "cb_serve.executor"]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, env=worker_env(), close_fds=True)
        assert self.proc.stdin is not None
        with self.proc.stdin:
            self.proc.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """After the driver said stop: waits for the process to end, then kills it."""
        for wait_s in (10, 5):
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                self.proc.kill()


def launch_processes(specs: list[WorkerSpec]) -> list[WorkerHandle]:
    """Fresh interpreters (``spawn``), or forks of a warm server (``forkserver``, CPU only)."""
    if all(multiproc_method(spec.device.split(":")[0]) == "forkserver" for spec in specs):
        return fork_workers(specs)
    return [WorkerProcess(spec) for spec in specs]
