"""Tensor-parallel workers as Ray actors (``distributed_executor_backend: ray``), in the bundles
of the replica's placement group."""

from __future__ import annotations

from typing import Any

from cb_serve.executor.worker import WorkerHandle, WorkerSpec, worker_main


class RayWorker:
    """A worker as a Ray actor (``ray.remote(RayWorker)``), placed in its replica's placement group."""

    def run(self, spec: WorkerSpec) -> None:
        worker_main(spec)


class RayWorkerHandle(WorkerHandle):
    def __init__(self, actor: Any, done: Any) -> None:
        self.actor, self.done = actor, done  # the actor, and the reference to its ``run``

    def is_alive(self) -> bool:
        import ray

        finished, _ = ray.wait([self.done], timeout=0)
        return not finished

    def stop(self) -> None:
        import ray

        ray.kill(self.actor)


def launch_ray_workers(specs: list[WorkerSpec]) -> list[WorkerHandle]:
    """One actor per rank, in bundle ``rank`` of the current placement group (the replica's; the
    replica itself holds bundle 0), each asking for one GPU on CUDA, one CPU otherwise."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()
    handles: list[WorkerHandle] = []
    for spec in specs:
        gpu = spec.device.startswith("cuda")
        resources: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0} if gpu else {"num_cpus": 1}
        if pg is not None:
            bundle = spec.rank
            resources["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
        actor = ray.remote(RayWorker).options(name=None, **resources).remote()
        handles.append(RayWorkerHandle(actor, actor.run.remote(spec)))
    return handles
