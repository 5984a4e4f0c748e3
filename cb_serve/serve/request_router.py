"""KV-cache-aware replica choice for Ray Serve's custom request router API.

Load: each engine replica reports (``record_routing_stats``, every ``routing_stats_period_s``)
its KV-cache usage, the requests it holds (running, waiting or just arrived) and its queued
prompt tokens, with a report number (``seq``). A replica's load is

    kv_cache_usage + num_waiting_tokens / token_budget + (num_requests + sent) / max_num_seqs

where ``sent`` counts the requests this router sent it that the report cannot know yet, so a
burst arriving between two reports spreads out instead of piling onto the replica that looked
idle. Each pick counts at once, before the request is even dispatched, so concurrent routing
decisions see each other. ``sent`` is exact without any clock: the router numbers its picks
and each request carries the router's random id and its pick number
(``EngineRequest.router_pick``); the replica reports, per router, the highest pick number that
reached it (``router_picks``, ``ReplicaReporter``); ``sent`` is this router's picks for that
replica numbered above it. A pick that never arrives (cancelled, or sent elsewhere) is
forgotten once a later one overtakes it, or after ``stale_after_s``.

Prefix affinity: the report also carries the replica's ``PrefixDigest`` (a Bloom filter over
the hashes of the KV blocks its prefix cache holds). The router hashes the request's leading
full blocks with the engine's own function (``prefix_block_hashes``), and a replica's
``expected_hit_tokens`` is the longest run of those blocks the digest holds; what counts is
its *advantage*, the part beyond what a majority of the replicas hold (``hit_advantage``). Among
the replicas whose load is within ``imbalance_threshold`` of the least loaded one, the cost

    load - prefix_weight * hit_advantage / token_budget

orders them (a hit saves prefill work in the same unit the load counts queued prompt tokens
in); the replicas beyond the threshold follow, by load. So a hot shared prefix that most
replicas hold decides nothing, and one that a single replica holds draws requests only until
its load pulls ahead by the threshold. A request with a session (the ``user`` field or an
``x-session-id`` header) goes first to the replica its session last went to, when that one
is within the threshold. Costs within ``TIE`` of each other are shuffled, so equal replicas
share the work at random.

Health: a replica without a report, or whose report has not changed for ``stale_after_s`` (its
``record_routing_stats`` is failing or timing out), is tried only after every replica with a
fresh report; among those Ray Serve picks the one with the fewest requests in flight. A
replica whose report says its engine is dead (``alive: False``), or that this process found
dead or closing since that report arrived (``replica_health``; the ingress then retries
elsewhere), is skipped; only when every replica is dead is one tried anyway, so the client
gets a fast, retryable 503 instead of waiting. Replicas at ``max_ongoing_requests`` are skipped
by Ray Serve, which then tries the next one (or queues the request, up to
``max_queued_requests``, beyond which the caller gets ``BackPressureError``).

Clocks: replicas and routers may run on nodes whose clocks disagree, so no time from one
process is compared with another's clock. A report's age counts from when this process first
saw its number (``replica_health.clock``, monotonic; Ray Serve hands every new report to
``update_replicas``), and unavailability marks are stamped on the same clock. The cost: a
report made before a failure but arriving after the ingress marked the replica lifts the mark
(the reports after it say whether the engine is alive), and a router that starts after a
replica's reports stopped takes the last one as new, so it ranks that replica fresh for up to
``stale_after_s``.

LoRA adapters: a replica reports the adapters it holds (``lora_adapters``: their ids); among the replicas
within the threshold, one holding the request's adapter costs ``adapter_weight`` less, so an
adapter's requests stay where it is loaded until that replica's load pulls ahead (Ray Serve's
model multiplexing prefers replicas with the model loaded in the same way).

The knobs are ``request_router_kwargs`` (``initialize_state``): ``stale_after_s``,
``prefix_weight`` (0 turns prefix affinity off), ``imbalance_threshold``,
``session_affinity`` and ``adapter_weight``.
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cb_serve import PrefixDigest
from cb_serve.serve import replica_health
from cb_serve.serve.engine_request import EngineRequest, InspectRequest
from cb_serve.serve.routing_report import ReplicaReport

TIE = 0.02  # loads closer than this are equal (less than one request when max_num_seqs < 50)
MAX_SESSIONS = 10_000  # sessions remembered (least recently routed forgotten first)


def replica_load(report: ReplicaReport, sent_since_report: int) -> float:
    """The load of a replica from its report plus the requests sent to it since."""
    budget, max_seqs = max(1, report.token_budget), max(1, report.max_num_seqs)
    return report.kv_cache_usage + report.num_waiting_tokens / budget + (report.requests + sent_since_report) / max_seqs


def expected_hit_tokens(report: ReplicaReport, request: EngineRequest | None) -> int:
    """Prompt tokens of ``request`` that the replica's reported prefix cache would serve."""
    digest = report.prefix_cache
    if request is None or not digest or not request.block_hashes or digest["block_size"] != request.block_size:
        return 0
    return PrefixDigest.from_dict(digest).hit_blocks(request.block_hashes) * request.block_size


def holds_adapter(report: ReplicaReport, request: EngineRequest | None) -> bool:
    """Whether the replica reported holding the request's LoRA adapter (in a slot or host memory)."""
    lora = request.lora_request if request is not None else None
    return lora is not None and lora.lora_int_id in report.lora_adapters


def hit_advantage(hits: dict[Any, int]) -> dict[Any, int]:
    """Each replica's expected hit beyond what a majority of the replicas holds: a prefix most
    replicas hold (one system prompt for everyone) is cheap anywhere, and the others get it with
    their first request, so it draws no traffic; a conversation's history held by one does."""
    if not hits:
        return {}
    common = sorted(hits.values(), reverse=True)[len(hits) // 2]
    return {r: max(0, h - common) for r, h in hits.items()}


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


def order_by_cost(
    loads: dict[Any, float],
    hit_fraction: dict[Any, float],
    prefix_weight: float,
    imbalance_threshold: float,
    preferred: Any = None,
    credit: dict[Any, float] | None = None,
) -> list[Any]:
    """Replicas within ``imbalance_threshold`` of the lowest load, by ``load - prefix_weight *
    hit_fraction - credit`` (``preferred`` first among them, if it is one), then the rest by load.
    ``hit_fraction``: expected hit tokens over the replica's token budget; ``credit``: more
    reasons to prefer a replica, in load units (it holds the request's LoRA adapter)."""
    if not loads:
        return []
    lowest = min(loads.values())
    credit = credit or {}
    near = {
        r: load - prefix_weight * hit_fraction.get(r, 0.0) - credit.get(r, 0.0)
        for r, load in loads.items()
        if load - lowest <= imbalance_threshold
    }
    far = {r: load for r, load in loads.items() if r not in near}
    ordered = order_by_load(near)
    if preferred in near:
        ordered.remove(preferred)
        ordered.insert(0, preferred)
    return ordered + order_by_load(far)


def replica_state(report: ReplicaReport, received: float | None, now: float, stale_after_s: float, marked: bool) -> str:
    """``"dead"`` (it said so, or a router saw it fail after its report arrived), ``"fresh"`` (a
    report that arrived at most ``stale_after_s`` ago) or ``"stale"`` (no report yet, or an old
    one). ``received`` and ``now`` are on this process's clock (``replica_health.clock``)."""
    if not report.alive or marked:
        return "dead"
    if received is not None and now - received <= stale_after_s:
        return "fresh"
    return "stale"


def rank_replicas(ordered_fresh: list[Any], stale: list[Any], dead: list[Any]) -> list[list[Any]]:
    """Ray Serve's ranks (tried in order; a full replica is skipped for the next): fresh replicas
    one by one, in the order given; then the stale ones together (Serve picks among them by
    requests in flight); dead ones only when there is nothing else."""
    ranks = [[replica] for replica in ordered_fresh]
    if not ranks and not stale:
        return [dead] if dead else []
    return ranks + ([stale] if stale else [])


def _request_key(pending_request: PendingRequest | None) -> Any:
    if pending_request is None:
        return None
    return getattr(pending_request.metadata, "internal_request_id", None) or id(pending_request)


def _target_replica(pending_request: PendingRequest | None) -> str | None:
    args = pending_request.args if pending_request is not None else ()
    return args[0].target_replica if args and isinstance(args[0], InspectRequest) else None


def _engine_request(pending_request: PendingRequest | None) -> EngineRequest | None:
    args = pending_request.args if pending_request is not None else ()
    return args[0] if args and isinstance(args[0], EngineRequest) else None


class KVCacheAwareRouter(RequestRouter):
    """Ray Serve request router for ``EngineReplica`` (``request_router_config``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.router_id = uuid.uuid4().hex[:16]  # per instance: replicas report picks per router
        self._pick_numbers = itertools.count(1)
        self._received: dict[ReplicaID, tuple[Any, float]] = {}  # report number, when first seen here
        self._sends: dict[ReplicaID, dict[Any, tuple[int, float]]] = {}  # request key -> pick, when
        self._picked: OrderedDict[Any, tuple[ReplicaID, int, float]] = OrderedDict()  # oldest first
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> replica unique id
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(
        self,
        stale_after_s: float = 10.0,
        prefix_weight: float = 1.0,
        imbalance_threshold: float = 0.25,
        session_affinity: bool = True,
        adapter_weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        """``prefix_weight``: how much an expected prefix hit of one token budget lowers a
        replica's cost (0: load only). ``imbalance_threshold``: how far above the least loaded
        replica (in load units: 1 = a full ``max_num_seqs``) a replica may be and still win by
        its cache or session. ``session_affinity``: follow the ``user`` / ``x-session-id``.
        ``adapter_weight``: how much holding the request's LoRA adapter lowers a replica's cost
        (as Ray Serve's model multiplexing prefers a replica with the model loaded; 0: ignore)."""
        assert stale_after_s > 0 and prefix_weight >= 0 and imbalance_threshold >= 0 and adapter_weight >= 0
        self.adapter_weight = adapter_weight
        self.stale_after_s = stale_after_s
        self.prefix_weight = prefix_weight
        self.imbalance_threshold = imbalance_threshold
        self.session_affinity = session_affinity

    # Ray Serve calls update_replicas with the whole replica set whenever any replica's info
    # changes: RunningReplicaInfo's hash covers routing_stats, so the controller broadcasts each
    # new report (Router.update_deployment_targets -> RequestRouter._update_running_replicas).
    # (Its on_replica_actor_died drops a dead actor until the next broadcast, which may list it
    # again: what this router keeps of it stays, so its last report keeps its age.)
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        now = replica_health.clock()
        for replica in replicas:
            self._received_at(replica.replica_id, ReplicaReport.from_dict(replica.routing_stats), now)
        self._forget_all_but({replica.replica_id for replica in replicas})

    def _forget_all_but(self, present: set[ReplicaID]) -> None:
        """Drops what this router keeps about replicas not in ``present``."""
        for state in (self._received, self._sends):
            for replica_id in [r for r in state if r not in present]:
                del state[replica_id]

    def _received_at(self, replica_id: ReplicaID, report: ReplicaReport, now: float) -> float | None:
        """When this process first saw the replica's current report (None: no report)."""
        number = report.number
        if number is None:
            return None
        seen = self._received.get(replica_id)
        if seen is None or seen[0] != number:
            seen = self._received[replica_id] = (number, now)
        return seen[1]

    def _record_send(self, key: Any, replica_id: ReplicaID, pick: int, now: float) -> None:
        """Counts request ``key`` against ``replica_id`` (moving it if it was counted elsewhere)."""
        previous = self._picked.pop(key, None)
        if previous is not None:
            self._sends.get(previous[0], {}).pop(key, None)
        self._picked[key] = (replica_id, pick, now)
        self._sends.setdefault(replica_id, {})[key] = (pick, now)
        while self._picked and now - next(iter(self._picked.values()))[2] > self.stale_after_s:
            self._picked.popitem(last=False)

    def _sent_since(self, replica_id: ReplicaID, reported_pick: int | None, now: float) -> int:
        """This router's picks for ``replica_id`` numbered above ``reported_pick`` (the highest
        its report says reached it; None: none) and at most ``stale_after_s`` old; forgets the others."""
        sends = self._sends.get(replica_id, {})
        floor = reported_pick if reported_pick is not None else 0
        for key in [k for k, (pick, t) in sends.items() if pick <= floor or now - t > self.stale_after_s]:
            del sends[key]
        return len(sends)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = _target_replica(pending_request)
        if target is not None:  # an inspector view of one replica: that one or none
            matching = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [matching] if matching else []
        now = replica_health.clock()
        request = _engine_request(pending_request)
        loads: dict[RunningReplica, float] = {}
        hits: dict[RunningReplica, int] = {}
        budgets: dict[RunningReplica, int] = {}
        credit: dict[RunningReplica, float] = {}
        stale: list[RunningReplica] = []
        dead: list[RunningReplica] = []
        for replica in candidate_replicas:
            report = ReplicaReport.from_dict(replica.routing_stats)
            received = self._received_at(replica.replica_id, report, now)
            marked = replica_health.marked_after(replica.replica_id.unique_id, received)
            state = replica_state(report, received, now, self.stale_after_s, marked)
            if state == "dead":
                dead.append(replica)
            elif state == "fresh":
                reported_pick = report.router_picks.get(self.router_id)
                loads[replica] = replica_load(report, self._sent_since(replica.replica_id, reported_pick, now))
                hits[replica] = expected_hit_tokens(report, request) if self.prefix_weight else 0
                budgets[replica] = max(1, report.token_budget)
                credit[replica] = self.adapter_weight * holds_adapter(report, request)
            else:
                self._sent_since(replica.replica_id, None, now)
                stale.append(replica)
        session = request.session_id if request is not None and self.session_affinity else None
        preferred_id = self._sessions.get(session) if session else None
        preferred = next((r for r in loads if r.replica_id.unique_id == preferred_id), None)
        advantage = hit_advantage(hits)
        fractions = {r: advantage[r] / budgets[r] for r in loads}
        ranks = rank_replicas(
            order_by_cost(loads, fractions, self.prefix_weight, self.imbalance_threshold, preferred, credit),
            stale,
            dead,
        )
        key = _request_key(pending_request)
        if request is not None:  # travels with the request: the replica reports what was expected of it
            request.expected_hit_tokens = {r.replica_id.unique_id: h for r, h in hits.items()}
            request.router_pick = (self.router_id, next(self._pick_numbers))
            if loads and key is not None:  # count the pick now; on_request_routed corrects it if Ray took another
                self._record_send(key, ranks[0][0].replica_id, request.router_pick[1], now)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = _request_key(pending_request)
        request = _engine_request(pending_request)
        if request is None:
            return
        picked = self._picked.get(key)
        if key is not None and request.router_pick is not None and (picked is None or picked[0] != replica_id):
            self._record_send(key, replica_id, request.router_pick[1], replica_health.clock())
        if request.session_id and self.session_affinity:
            self._sessions[request.session_id] = replica_id.unique_id
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
