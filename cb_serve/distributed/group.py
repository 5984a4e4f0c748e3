"""The tensor-parallel communicator: a process group of its own (gloo on CPU, NCCL on CUDA),
made from a TCP store without torch.distributed's global default group, so several engines
(and tests) can live in one process."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # backstop: a dead peer fails a collective at once


class TensorParallelGroup:
    """``all_reduce`` sums partial results in place; ``all_gather`` concatenates along the last
    dimension. One rank (``size == 1``) communicates nothing."""

    def __init__(self, rank: int, size: int, process_group=None) -> None:
        assert (process_group is None) == (size == 1)
        self.rank, self.size, self.pg = rank, size, process_group

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
        return cls(rank, size, pg)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.pg is not None:
            self.pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.pg is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)
