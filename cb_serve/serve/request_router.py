"""Load-aware replica choice for Ray Serve's custom request router API.

Policy: each engine replica reports (``record_routing_stats``) its KV-cache usage, running
and waiting requests and queued prompt tokens. A replica's load is

    kv_cache_usage + num_waiting_tokens / token_budget + num_running / max_num_seqs

plus what this router sent it since that report (each request counts 1 / max_num_seqs), so
a burst of requests between two reports spreads out instead of piling onto the replica that
looked idle. Replicas rank by load; ties (within 0.02) are broken at random. A replica with
no report, or a report older than ``stale_after_s``, ranks by this router's own in-flight
count alone, after the replicas with fresh reports.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


def replica_load(stats: dict[str, Any], sent_since_report: int) -> float:
    budget = max(1, stats.get("token_budget", 1))
    max_seqs = max(1, stats.get("max_num_seqs", 1))
    return (
        stats.get("kv_cache_usage", 0.0)
        + stats.get("num_waiting_tokens", 0) / budget
        + (stats.get("num_running", 0) + stats.get("num_waiting", 0) + sent_since_report) / max_seqs
    )


def rank_by_load(loads: dict[Any, float], tie: float = 0.02) -> list[list[Any]]:
    """Groups keys into ranks of (nearly) equal load, lowest first, shuffled within a rank."""
    ranks: list[list[Any]] = []
    for key in sorted(loads, key=loads.get):
        if ranks and loads[key] - loads[ranks[-1][0]] <= tie:
            ranks[-1].append(key)
        else:
            ranks.append([key])
    for r in ranks:
        random.shuffle(r)
    return ranks


class KVCacheAwareRouter(RequestRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stale_after_s = 10.0
        self._sent: dict[ReplicaID, int] = defaultdict(int)
        self._report_time: dict[ReplicaID, float] = {}

    def initialize_state(self, stale_after_s: float = 10.0, **kwargs: Any) -> None:
        self.stale_after_s = stale_after_s

    def _sent_since_report(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats or {}
        reported = stats.get("time")
        if reported is not None and reported != self._report_time.get(replica.replica_id):
            self._report_time[replica.replica_id] = reported
            self._sent[replica.replica_id] = 0  # the new report already counts them
        return self._sent[replica.replica_id]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        now = time.time()
        fresh, stale = {}, {}
        for replica in candidate_replicas:
            stats = replica.routing_stats or {}
            sent = self._sent_since_report(replica)
            if stats and now - stats.get("time", 0.0) <= self.stale_after_s:
                fresh[replica] = replica_load(stats, sent)
            else:
                stale[replica] = float(sent)
        return rank_by_load(fresh) + rank_by_load(stale, tie=0.0)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._sent[replica_id] += 1
