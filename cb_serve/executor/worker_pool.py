"""The driver's side of tensor parallelism: it starts ranks 1..N-1 (fresh interpreters running
``python -m cb_serve.executor``, or Ray actors in the replica's placement group), joins their
process group as rank 0, and sends each step's batch to all of them once; the scheduler, block
manager and sampler stay on the driver."""

from __future__ import annotations

import datetime
import functools
import logging
import os
import pickle
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from cb_serve.config import EngineConfig
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.errors import EngineFatalError
from cb_serve.executor.processes import launch_processes
from cb_serve.executor.ray_workers import launch_ray_workers
from cb_serve.executor.worker import STORE_TIMEOUT_S, WorkerHandle, WorkerSpec

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600  # loading a large model's shard
WATCHDOG_INTERVAL_S = 0.5  # how often the driver looks for a dead worker once serving
FAILURE_GRACE_S = 1.0  # after a failed step, how long to wait for a dying worker's exit to show
T = TypeVar("T")


def executor_backend(config: EngineConfig) -> str:
    """``mp`` (worker processes) or ``ray`` (actors): ``auto`` picks ray inside a Ray worker that
    holds a placement group (a Serve replica with bundles: its workers then land in its bundles,
    on its node), else mp."""
    if config.distributed_executor_backend != "auto":
        return config.distributed_executor_backend
    try:
        import ray
    except ImportError:
        return "mp"
    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return "mp"
    return "ray" if ray.util.get_current_placement_group() is not None else "mp"


def worker_devices(device: torch.device, size: int, backend: str) -> list[str]:
    """Each worker rank's device: ``cpu``; on CUDA the GPUs after the driver's (``cuda:N``), or each
    Ray actor's own GPU (Ray shows an actor only its GPUs, as ``cuda``)."""
    if device.type != "cuda":
        return ["cpu"] * (size - 1)
    if backend == "ray":
        return ["cuda"] * (size - 1)
    first = device.index or 0
    available = torch.cuda.device_count()
    if first + size > available:
        message = f"tensor_parallel_size={size} from cuda:{first} needs {first + size} GPUs; {available} visible."
        raise ValueError(message)
    return [f"cuda:{first + rank}" for rank in range(1, size)]


class WorkerPool:
    """Ranks 1..N-1 of one engine. ``group`` is the driver's (rank 0) communicator."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.tensor_parallel_size
        assert size > 1
        self.size, self.backend = size, executor_backend(config)
        host = "127.0.0.1" if self.backend == "mp" else _node_ip()
        authkey = secrets.token_bytes(32)
        self.listener = Listener((host, 0), authkey=authkey)
        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        self.store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
        threads = config.num_threads or (max(1, (os.cpu_count() or 1) // size) if device.type == "cpu" else None)
        specs = [
            WorkerSpec(config, rank, size, dev, host, self.listener.address[1], self.store.port, authkey, threads)
            for rank, dev in zip(range(1, size), worker_devices(device, size, self.backend))
        ]
        launch = launch_ray_workers if self.backend == "ray" else launch_processes
        self.handles: list[WorkerHandle] = launch(specs)
        self.conns: list[Connection] = []
        self.pids: list[int] = []
        self._watchdogs: list[WorkerWatchdog] = []
        self._finalizer = weakref.finalize(self, _stop, self._watchdogs, self.conns, self.handles, self.listener)
        hellos = self._await("connect", lambda: [self._accept() for _ in specs])
        hellos.sort()
        self.conns[:] = [conn for _, _, conn in hellos]
        self.pids = [pid for _, pid, _ in hellos]
        join = lambda: TensorParallelGroup.connect(self.store, 0, size, device)  # noqa: E731
        self.group = self._await("join the process group", join)

    def start(self, num_blocks: int) -> None:
        """Has every worker allocate its KV cache of ``num_blocks`` blocks; returns once all are ready."""
        for conn in self.conns:
            conn.send(num_blocks)
        answers = self._await("load the model", lambda: [conn.recv() for conn in self.conns])
        assert answers == ["ready"] * len(self.conns), answers
        # Neither callable holds the pool: dropping it still runs its finalizer, which stops the watch.
        dead = functools.partial(_dead_ranks, self.handles)
        self._watchdogs.append(WorkerWatchdog(dead, functools.partial(_abort_group, self.group)))

    def send_step(self, batch: Any) -> None:
        payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as e:
            raise EngineFatalError(f"a tensor-parallel worker is gone ({self.dead_workers()})") from e

    def dead_workers(self) -> list[int]:
        """Ranks whose process or actor has ended."""
        return _dead_ranks(self.handles)

    def failure(self, error: BaseException | None = None) -> EngineFatalError:
        """The fatal error of a step that failed with ``error`` (None: one whose collectives the
        watchdog aborted), naming the dead ranks (a killed worker's exit may show a moment after
        its connections closed)."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while not (dead := self.dead_workers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        cause = f"worker rank(s) {dead} died" if dead else (self.group.aborted or "a rank failed")
        detail = f": {error}" if error is not None else ""
        return EngineFatalError(f"the tensor-parallel group cannot go on, {cause}{detail}")

    def shutdown(self) -> None:
        self._finalizer()

    def _accept(self) -> tuple[int, int, Connection]:
        conn = self.listener.accept()
        rank, pid = conn.recv()
        return rank, pid, conn

    def _await(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, run while the workers are watched: raises once one of them has died."""
        result: list[Any] = []

        def target() -> None:
            try:
                result.append(("ok", fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                result.append(("error", e))

        thread = threading.Thread(target=target, name=f"tp-{what}", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while thread.is_alive():
            thread.join(0.2)
            dead = self.dead_workers()
            if dead or time.monotonic() > deadline:
                self.shutdown()
                reason = f"worker rank(s) {dead} exited" if dead else f"no answer in {START_TIMEOUT_S} s"
                raise RuntimeError(f"tensor-parallel workers failed to {what}: {reason} (see their log)")
        kind, value = result[0]
        if kind == "error":
            self.shutdown()
            raise value
        return value


class WorkerWatchdog:
    """Looks for dead workers every ``interval_s`` from a daemon thread and, the first time
    ``dead_workers()`` names any, calls ``abort(dead)`` once and ends. Under NCCL a collective
    whose peer died never completes, so the driver's step would hang until the group's timeout;
    aborting the group ends it. ``stop`` ends the watch without aborting (idempotent)."""

    def __init__(
        self,
        dead_workers: Callable[[], list[int]],
        abort: Callable[[list[int]], object],
        interval_s: float = WATCHDOG_INTERVAL_S,
    ) -> None:
        self._stopped = threading.Event()
        args = (dead_workers, abort, interval_s, self._stopped)  # the thread holds no watchdog, no pool
        self._thread = threading.Thread(target=_watch, args=args, name="tp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the watch; once it returns, no abort starts."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    @property
    def running(self) -> bool:
        """Whether the watch goes on (it ends once it has aborted, or on ``stop``)."""
        return self._thread.is_alive()


def _watch(
    dead_workers: Callable[[], list[int]],
    abort: Callable[[list[int]], object],
    interval_s: float,
    stopped: threading.Event,
) -> None:
    while not stopped.wait(interval_s):
        try:
            dead = dead_workers()
        except Exception:  # noqa: BLE001 - looked at again next time
            logger.debug("looking for dead tensor-parallel workers failed", exc_info=True)
            continue
        if dead and not stopped.is_set():
            abort(dead)
            return


def _dead_ranks(handles: list[WorkerHandle]) -> list[int]:
    return [rank for rank, handle in enumerate(handles, 1) if not handle.is_alive()]


def _abort_group(group: TensorParallelGroup, dead: list[int]) -> None:
    logger.error("tensor-parallel worker rank(s) %s died: aborting the driver's process group", dead)
    group.abort(f"worker rank(s) {dead} died")


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _stop(
    watchdogs: list[WorkerWatchdog], conns: list[Connection], handles: list[WorkerHandle], listener: Listener
) -> None:
    """Stops the watch (workers told to stop are no failure), tells every worker to stop, then
    makes sure it has (the pool's finalizer: idempotent)."""
    for watchdog in watchdogs:
        watchdog.stop()
    for conn in conns:
        try:
            conn.send_bytes(b"")
            conn.close()
        except OSError:
            pass
    listener.close()
    for handle in handles:
        handle.stop()
