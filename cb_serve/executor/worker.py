"""A tensor-parallel worker (ranks 1..N-1): loads its shard, then runs each step the driver
sends, in step with the driver's collectives, until the driver says stop or goes away."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing.connection import Client

import torch
import torch.distributed as dist

from cb_serve.config import EngineConfig

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 300


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join its driver (it pickles: workers are processes or Ray actors)."""

    config: EngineConfig
    rank: int
    size: int
    device: str  # "cpu", or this worker's own GPU
    host: str  # the driver's address: its control listener and its TCP store
    control_port: int
    store_port: int
    authkey: bytes
    num_threads: int | None = None


def worker_main(spec: WorkerSpec) -> None:
    """Runs until the driver sends the stop message or closes its connection."""
    from cb_serve.distributed.group import TensorParallelGroup
    from cb_serve.distributed.sharding import shard_for
    from cb_serve.model_executor.cache_tensors import num_state_snapshots, num_verify_states, state_bytes_per_slot
    from cb_serve.model_executor.device_context import bind_thread_to_device, concrete_device
    from cb_serve.model_executor.model_runner import ModelRunner
    from cb_serve.model_executor.model_setup import ModelSetup

    conn = Client((spec.host, spec.control_port), authkey=spec.authkey)
    conn.send((spec.rank, os.getpid()))
    try:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        device = concrete_device(torch.device(spec.device))  # a Ray actor's "cuda": its own GPU, index 0
        bind_thread_to_device(device)  # kernels, graphs and NCCL run on this worker's GPU
        setup = ModelSetup.from_config(spec.config, device)
        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        store = dist.TCPStore(spec.host, spec.store_port, spec.size, False, timeout=timeout)
        tp = TensorParallelGroup.connect(store, spec.rank, spec.size, device)
        shard = shard_for(setup.hf_config, spec.rank, spec.size, spec.config.enable_expert_parallel)
        model = setup.load_model(shard, tp)
        num_blocks = conn.recv()
        runner = ModelRunner(
            model,
            num_blocks,
            setup.block_size,
            setup.kv_cache_dtype,
            device,
            kv_layout=setup.kv_layout,
            num_state_slots=spec.config.max_num_seqs,
            num_state_snapshots=num_state_snapshots(spec.config, state_bytes_per_slot(model)),
            num_verify_states=num_verify_states(spec.config),
        )
        conn.send("ready")
        while payload := conn.recv_bytes():  # empty: stop
            runner.compute_logits(runner.to_device(pickle.loads(payload)))
    except EOFError:
        logger.info("tensor-parallel worker %d: the driver went away", spec.rank)
    finally:
        conn.close()


class WorkerHandle(ABC):
    """The driver's handle on one worker rank (a process, or a Ray actor)."""

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def stop(self) -> None:
        """Makes sure the worker has ended (after the driver told it to stop)."""
