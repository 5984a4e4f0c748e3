"""``Executor``: what the engine runs each step through, hiding how many ranks compute it (vLLM
v1's executor). One rank (``UniProcExecutor``) or a tensor-parallel group of processes or Ray
actors (``TensorParallelExecutor``); the engine sees the same three calls."""

from __future__ import annotations

from abc import ABC, abstractmethod

from cb_serve.model_executor.model_runner import ModelRunner, StepResult
from cb_serve.model_executor.step_output import AsyncStepOutput
from cb_serve.sequence import SchedulerOutput


class Executor(ABC):
    """Runs the driver's ``runner`` (rank 0: it alone samples) and any other ranks in step."""

    runner: ModelRunner

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """One step on every rank. ``EngineFatalError`` when the ranks cannot go on together."""

    supports_async_scheduling = False  # ``launch``: the driver's sampled ids feed the next step on the device

    def launch(self, sched: SchedulerOutput) -> AsyncStepOutput:
        """Launches one step without waiting for it (async scheduling)."""
        raise NotImplementedError(f"{type(self).__name__} runs steps synchronously")

    def check_health(self) -> list[int]:
        """Ranks whose process has died (safe from any thread); empty while all are alive."""
        return []

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (none for one rank)."""
        return []

    def shutdown(self) -> None:  # noqa: B027 - one rank has nothing to stop
        """Stops the other ranks (idempotent)."""
