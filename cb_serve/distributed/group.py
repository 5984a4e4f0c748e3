"""The tensor-parallel communicator: a process group of its own (gloo on CPU, NCCL on CUDA),
made from a TCP store without torch.distributed's global default group, so several engines
(and tests) can live in one process."""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A backstop, not how a dead peer is noticed. Gloo fails a collective at once when a peer's
# connection closes; NCCL does not: a kernel waiting on a dead peer spins until this timeout's
# watchdog fires. So the driver watches its workers and aborts its group when one dies
# (``WorkerWatchdog`` in ``executor.worker_pool``).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


class TensorParallelGroup:
    """``all_reduce`` sums partial results in place; ``all_gather`` concatenates along the last
    dimension. One rank (``size == 1``) communicates nothing. After ``abort`` every collective
    raises."""

    def __init__(self, rank: int, size: int, process_group=None, device: torch.device | None = None) -> None:
        assert (process_group is None) == (size == 1)
        self.rank, self.size, self.pg, self.device = rank, size, process_group, device
        self.aborted: str | None = None  # why, once aborted (``abort``)
        self._abort_lock = threading.Lock()

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(0, 1)

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> TensorParallelGroup:
        """Joins the group of ``size`` ranks that meet in ``store`` (every rank calls this)."""
        store = dist.PrefixStore("cb_serve_tp", store)
        if device.type == "cuda":  # built as torch.distributed.new_group builds it: store, rank, size, options
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        return cls(rank, size, pg, device)

    def abort(self, reason: str) -> bool:
        """Aborts the communicator, from any thread, in a collective or not: under NCCL a collective
        in flight ends, and later ones raise. Idempotent: True only for the call that aborted."""
        with self._abort_lock:
            if self.aborted is not None:
                return False
            self.aborted = reason  # set first: whoever a returning collective wakes sees it
        if self.pg is None:
            return True
        try:
            # ProcessGroupNCCL.abort() calls ncclCommAbort on its communicators, which makes their
            # pending NCCL kernels exit: the host sync waiting behind them returns (its data is
            # garbage, hence ``aborted``), and later collectives raise. Gloo's abort leaves a
            # collective in flight alone; there a dead peer's closed connection fails it.
            if self.device is not None and self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    self.pg.abort()
            else:
                self.pg.abort()
        except Exception:  # noqa: BLE001 - the group is unusable either way
            logger.warning("aborting the tensor-parallel process group failed", exc_info=True)
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.pg is not None:
            self._check_open()
            self.pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.pg is None:
            return x
        self._check_open()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def _check_open(self) -> None:
        if self.aborted is not None:
            raise RuntimeError(f"the tensor-parallel group was aborted: {self.aborted}")
