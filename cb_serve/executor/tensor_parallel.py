"""Tensor parallelism: the driver's runner is rank 0 and samples; ranks 1..N-1 (``WorkerPool``:
processes or Ray actors) get each step's batch and run their shard in step with its collectives."""

from __future__ import annotations

from cb_serve.executor.base import Executor
from cb_serve.executor.worker_pool import WorkerPool
from cb_serve.model_executor.device_context import device_context
from cb_serve.model_executor.model_runner import ModelRunner, StepResult
from cb_serve.sequence import SchedulerOutput


class TensorParallelExecutor(Executor):
    def __init__(self, runner: ModelRunner, workers: WorkerPool) -> None:
        self.runner = runner
        self.workers = workers

    def execute(self, sched: SchedulerOutput) -> StepResult:
        with device_context(self.runner.device):  # a failed broadcast step is fatal (``ModelRunner.execute``)
            return self.runner.execute(sched, broadcast=self.workers.send_step)

    def check_health(self) -> list[int]:
        return self.workers.dead_workers()

    @property
    def worker_pids(self) -> list[int]:
        return list(self.workers.pids)

    def shutdown(self) -> None:
        self.workers.shutdown()
