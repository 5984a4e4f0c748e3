"""One rank: the engine's own thread runs the model."""

from __future__ import annotations

from cb_serve.executor.base import Executor
from cb_serve.model_executor.device_context import device_context
from cb_serve.model_executor.model_runner import ModelRunner, StepResult
from cb_serve.model_executor.step_output import AsyncStepOutput
from cb_serve.sequence import SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, sched: SchedulerOutput) -> StepResult:
        with device_context(self.runner.device):  # Triton launches on the calling thread's current device
            return self.runner.execute(sched)

    supports_async_scheduling = True

    def launch(self, sched: SchedulerOutput) -> AsyncStepOutput:
        with device_context(self.runner.device):
            return self.runner.launch(sched)
