"""Tensor parallelism: the driver's runner is rank 0 and samples; ranks 1..N-1 (``WorkerPool``:
processes or Ray actors) get each step's batch and run their shard in step with its collectives."""

from __future__ import annotations

from cb_serve.errors import EngineFatalError
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
        """A failed broadcast step is fatal (``ModelRunner.execute``), and so is any step during
        which the watchdog aborted the group (a dead worker): under NCCL the collectives it ended
        return garbage instead of raising."""
        group = self.workers.group
        with device_context(self.runner.device):
            try:
                result = self.runner.execute(sched, broadcast=self.workers.send_step)
            except Exception as e:
                if isinstance(e, EngineFatalError) or group.aborted is not None:
                    raise self.workers.failure(e) from e
                raise  # this rank's own failure: the step's requests fail, the engine goes on
        if group.aborted is not None:
            raise self.workers.failure()
        return result

    def check_health(self) -> list[int]:
        return self.workers.dead_workers()

    @property
    def worker_pids(self) -> list[int]:
        return list(self.workers.pids)

    def shutdown(self) -> None:
        self.workers.shutdown()
