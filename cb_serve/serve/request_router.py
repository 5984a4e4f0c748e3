"""Load-aware replica choice for Ray Serve's custom request router API.

Policy: each engine replica reports (``record_routing_stats``, every
``routing_stats_period_s``) its KV-cache usage, the requests it holds (running, waiting or
just arrived) and its queued prompt tokens, stamped with the time of the report. A
replica's load is

    kv_cache_usage + num_waiting_tokens / token_budget + (num_requests + sent) / max_num_seqs

where ``sent`` counts the requests this router sent it after that report (the report cannot
know them yet), so a burst arriving between two reports spreads out instead of piling onto
the replica that looked idle. Each pick counts at once, before the request is even
dispatched, so concurrent routing decisions see each other.

Replicas are tried lowest load first; loads within ``TIE`` of each other are shuffled, so
equally loaded replicas share the work at random. A replica without a report, or whose
report is older than ``stale_after_s`` (its ``record_routing_stats`` is failing or timing
out), is tried only after every replica with a fresh report; among those Ray Serve picks
the one with the fewest requests in flight. A replica whose report says its engine is dead
(``alive: False``), or that this process found dead or closing since that report
(``replica_health``; the ingress then retries elsewhere), is skipped; only when every
replica is dead is one tried anyway, so the client gets a fast, retryable 503 instead of
waiting. Replicas at ``max_ongoing_requests`` are skipped by Ray Serve, which then tries the
next one (or queues the request, up to ``max_queued_requests``, beyond which the caller gets
``BackPressureError``).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, defaultdict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cb_serve.serve import replica_health

TIE = 0.02  # loads closer than this are equal (less than one request when max_num_seqs < 50)


def replica_load(stats: dict[str, Any], sent_since_report: int) -> float:
    """The load of a replica from its report plus the requests sent to it since."""
    budget = max(1, stats.get("token_budget", 1))
    max_seqs = max(1, stats.get("max_num_seqs", 1))
    requests = stats.get("num_requests", stats.get("num_running", 0) + stats.get("num_waiting", 0))
    return (
        stats.get("kv_cache_usage", 0.0)
        + stats.get("num_waiting_tokens", 0) / budget
        + (requests + sent_since_report) / max_seqs
    )


def order_by_load(loads: dict[Any, float], tie: float = TIE) -> list[Any]:
    """Keys by increasing load; runs of keys whose loads are within ``tie`` of the run's
    lowest are shuffled."""
    ordered: list[Any] = []
    group: list[Any] = []
    for key in sorted(loads, key=loads.get):
        if group and loads[key] - loads[group[0]] > tie:
            random.shuffle(group)
            ordered += group
            group = []
        group.append(key)
    random.shuffle(group)
    return ordered + group


def replica_state(stats: dict[str, Any], now: float, stale_after_s: float, marked_unavailable: bool) -> str:
    """``"dead"`` (it said so, or a router saw it fail after its report), ``"fresh"`` (a report
    at most ``stale_after_s`` old) or ``"stale"`` (no report yet, or an old one)."""
    reported = stats.get("time")
    if stats.get("alive") is False or marked_unavailable:
        return "dead"
    if reported is not None and now - reported <= stale_after_s:
        return "fresh"
    return "stale"


def rank_replicas(fresh: dict[Any, float], stale: list[Any], dead: list[Any]) -> list[list[Any]]:
    """Ray Serve's ranks (tried in order; a full replica is skipped for the next): fresh replicas
    one by one, lowest load first; then the stale ones together (Serve picks among them by
    requests in flight); dead ones only when there is nothing else."""
    ranks = [[replica] for replica in order_by_load(fresh)]
    if not ranks and not stale:
        return [dead] if dead else []
    return ranks + ([stale] if stale else [])


def _request_key(pending_request: PendingRequest | None) -> Any:
    if pending_request is None:
        return None
    return getattr(pending_request.metadata, "internal_request_id", None) or id(pending_request)


class KVCacheAwareRouter(RequestRouter):
    """Ray Serve request router for ``EngineReplica`` (``request_router_config``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stale_after_s = 10.0
        self._sends: dict[ReplicaID, dict[Any, float]] = defaultdict(dict)  # request key -> time sent
        self._picked: OrderedDict[Any, tuple[ReplicaID, float]] = OrderedDict()  # oldest first

    def initialize_state(self, stale_after_s: float = 10.0, **kwargs: Any) -> None:
        self.stale_after_s = stale_after_s

    def _record_send(self, key: Any, replica_id: ReplicaID, now: float) -> None:
        """Counts request ``key`` against ``replica_id`` (moving it if it was counted elsewhere)."""
        previous = self._picked.pop(key, None)
        if previous is not None:
            self._sends[previous[0]].pop(key, None)
        self._picked[key] = (replica_id, now)
        self._sends[replica_id][key] = now
        while self._picked and now - next(iter(self._picked.values()))[1] > self.stale_after_s:
            self._picked.popitem(last=False)

    def _sent_since(self, replica_id: ReplicaID, since: float) -> int:
        """Requests sent to ``replica_id`` after ``since``; forgets the older ones."""
        sends = self._sends[replica_id]
        for key in [k for k, t in sends.items() if t <= since]:
            del sends[key]
        return len(sends)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        now = time.time()
        fresh: dict[RunningReplica, float] = {}
        stale: list[RunningReplica] = []
        dead: list[RunningReplica] = []
        for replica in candidate_replicas:
            stats = replica.routing_stats or {}
            marked = replica_health.marked_after(replica.replica_id.unique_id, stats.get("time"))
            state = replica_state(stats, now, self.stale_after_s, marked)
            if state == "dead":
                dead.append(replica)
            elif state == "fresh":
                fresh[replica] = replica_load(stats, self._sent_since(replica.replica_id, stats["time"]))
            else:
                self._sent_since(replica.replica_id, now - self.stale_after_s)
                stale.append(replica)
        ranks = rank_replicas(fresh, stale, dead)
        key = _request_key(pending_request)
        if fresh and key is not None:  # count the pick now; on_request_routed corrects it if Ray took another
            self._record_send(key, ranks[0][0].replica_id, now)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = _request_key(pending_request)
        picked = self._picked.get(key)
        if key is not None and (picked is None or picked[0] != replica_id):
            self._record_send(key, replica_id, time.time())
