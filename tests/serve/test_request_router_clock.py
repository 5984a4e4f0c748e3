"""``KVCacheAwareRouter`` without Ray or a cluster (issue 22): it compares no replica's clock
with its own. Replicas report with a wall clock skewed by an hour either way; the router's
clock (``replica_health.clock``) is a fake monotonic one. Fresh reports rank as fresh, reports
that stop changing go stale by the router's clock, the requests sent after a report are counted
exactly, unavailable marks hold until a later report arrives, and replicas that left are
forgotten."""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace
from typing import Any

import pytest

from cb_serve import SamplingParams
from cb_serve.serve import replica_health
from cb_serve.serve.engine_request import EngineRequest
from cb_serve.serve.request_router import KVCacheAwareRouter
from cb_serve.serve.routing_report import MAX_ROUTERS, ReplicaReport, ReplicaReporter

pytest.importorskip("ray.serve")
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

STALE_AFTER_S = 10.0
SKEWS = [-3600.0, 3600.0]  # the replicas' wall clock against the router's node
DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="clock-test")


class FakeReplica:
    """What the request router reads of a replica (``RunningReplica``), plus the replica's own
    side of the report: its ``ReplicaReporter`` and the requests that reached it."""

    def __init__(self, name: str, skew: float) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 256
        self.skew = skew
        self.reporter = ReplicaReporter()
        self.held: list[EngineRequest] = []
        self.routing_stats: dict[str, Any] = {}

    def receive(self, request: EngineRequest) -> None:
        self.held.append(request)
        self.reporter.arrived(request)

    def report(self, other_requests: int = 0) -> None:
        """A new routing report (``EngineReplica.record_routing_stats``), stamped by its own clock."""
        load = dict(num_requests=len(self.held) + other_requests, token_budget=256, max_num_seqs=8)
        self.routing_stats = self.reporter.report(lambda: {**load, "time": time.time() + self.skew})

    async def get_queue_len(self, *, deadline_s: float) -> int:  # Ray probes new replicas
        return len(self.held)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(replica_health, "clock", fake)
    monkeypatch.setattr(replica_health, "_marked", {})
    return fake


@pytest.fixture
def router(clock) -> KVCacheAwareRouter:
    loop = asyncio.new_event_loop()  # the router keeps the loop it first ran on
    r = KVCacheAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    r.initialize_state(stale_after_s=STALE_AFTER_S, prefix_weight=0.0)
    r.test_loop = loop
    yield r
    loop.close()


_ids = itertools.count()


def pending() -> SimpleNamespace:
    """A ``PendingRequest`` as the router reads it: an ``EngineRequest`` and an internal id."""
    request = EngineRequest(request_id=f"r{next(_ids)}", params=SamplingParams(max_tokens=1), prompt_token_ids=[1])
    return SimpleNamespace(args=[request], metadata=SimpleNamespace(internal_request_id=request.request_id))


def choose(
    router: KVCacheAwareRouter, replicas: list[FakeReplica], p: SimpleNamespace | None = None
) -> tuple[list[list[str]], EngineRequest]:
    """Ranks as names (``[["a"], ["b"]]``) and the request routed."""
    p = p or pending()
    ranks = router.test_loop.run_until_complete(router.choose_replicas(replicas, p))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks], p.args[0]


def arrive(router: KVCacheAwareRouter, replicas: list[FakeReplica]) -> None:
    """Ray Serve hands the router every new report through ``update_replicas`` (on its loop)."""

    async def update() -> None:
        router.update_replicas(replicas)
        await asyncio.sleep(0.01)  # lets Ray's queue-length probe of new replicas finish

    router.test_loop.run_until_complete(update())


@pytest.mark.parametrize("skew", SKEWS)
def test_fresh_reports_rank_fresh_and_go_stale_by_the_routers_clock(router, clock, skew):
    a, b = FakeReplica("a", skew), FakeReplica("b", skew)
    a.report(), b.report(other_requests=2)
    arrive(router, [a, b])
    assert choose(router, [a, b])[0] == [["a"], ["b"]]  # both fresh: one rank each, by load
    clock.now += STALE_AFTER_S - 1
    b.report(other_requests=2)  # b keeps reporting; a's reports stopped
    arrive(router, [a, b])
    clock.now += 2
    ranks, request = choose(router, [a, b])
    assert ranks == [["b"], ["a"]] and set(request.expected_hit_tokens) == {"b"}  # a stale: after b
    clock.now += STALE_AFTER_S
    assert choose(router, [a, b])[0] == [["a", "b"]]  # both stale: one rank, Ray Serve picks
    a.report()
    arrive(router, [a, b])
    assert choose(router, [a, b])[0][0] == ["a"]


def test_a_report_is_aged_from_its_arrival_not_from_when_the_router_looks(router, clock):
    a = FakeReplica("a", 0.0)
    a.report()
    arrive(router, [a])
    clock.now += STALE_AFTER_S + 1  # no request in between: the router first looks now
    assert choose(router, [a, FakeReplica("b", 0.0)])[0] == [["a", "b"]]


def test_a_report_whose_time_goes_backwards_is_still_new(router, clock):
    """Only the report number tells reports apart: a replica clock stepped back changes nothing."""
    a = FakeReplica("a", 0.0)
    a.report()
    arrive(router, [a])
    for _ in range(3):
        clock.now += STALE_AFTER_S - 1
        a.skew -= 3600
        a.report()
        arrive(router, [a])
    assert choose(router, [a])[0] == [["a"]]


@pytest.mark.parametrize("skew", SKEWS)
@pytest.mark.parametrize(("others_on_b", "first"), [(3, "b"), (5, "a")])
def test_requests_sent_after_a_report_are_counted_once(router, clock, skew, others_on_b, first):
    """The router sends four requests to a; two reach it before a's next report. Its load is then 2
    reported + 2 in flight = 4/8: above b's 3/8 (counting none in flight would put a first),
    below b's 5/8 (counting all four again would put b first)."""
    a, b = FakeReplica("a", skew), FakeReplica("b", skew)
    a.report(), b.report(others_on_b)
    arrive(router, [a, b])
    sent = [choose(router, [a])[1] for _ in range(4)]
    for request in sent[:2]:
        a.receive(request)
    clock.now += 1
    a.report()
    arrive(router, [a, b])
    assert a.routing_stats["num_requests"] == 2
    assert choose(router, [a, b])[0][0] == [first]


def test_a_pick_overtaken_by_a_later_one_is_forgotten(router, clock):
    """Of three requests sent to a, only the last arrives: the two before it are no longer
    counted (a: 1/8, below b's 2/8; counting them would make it 3/8)."""
    a, b = FakeReplica("a", 0.0), FakeReplica("b", 0.0)
    a.report(), b.report(other_requests=2)
    arrive(router, [a, b])
    *_, last = (choose(router, [a])[1] for _ in range(3))
    a.receive(last)
    clock.now += 1
    a.report()
    arrive(router, [a, b])
    assert choose(router, [a, b])[0][0] == ["a"]


def test_a_pick_that_never_arrives_expires_by_the_routers_clock(router, clock):
    """Three requests sent to a never arrive, and its reports never hear of this router: they
    count until ``stale_after_s`` has passed (a: 2/8 + 3/8, then 2/8; b: 3/8)."""
    a, b = FakeReplica("a", 0.0), FakeReplica("b", 0.0)
    a.report(other_requests=2), b.report(other_requests=3)
    arrive(router, [a, b])
    for _ in range(3):
        choose(router, [a])
    clock.now += 1
    a.report(other_requests=2), b.report(other_requests=3)
    arrive(router, [a, b])
    assert choose(router, [a, b])[0][0] == ["b"]
    clock.now += STALE_AFTER_S
    a.report(other_requests=2), b.report(other_requests=3)
    arrive(router, [a, b])
    assert choose(router, [a, b])[0][0] == ["a"]


@pytest.mark.parametrize("skew", SKEWS)
def test_an_unavailable_mark_holds_until_a_later_report_arrives(router, clock, skew):
    a, b = FakeReplica("a", skew), FakeReplica("b", skew)
    a.report(), b.report(other_requests=3)
    arrive(router, [a, b])
    clock.now += 1
    replica_health.mark_unavailable("a")
    clock.now += 1
    assert choose(router, [a, b])[0] == [["b"]]  # a skipped, whatever its report's own time says
    b.report(other_requests=3)
    arrive(router, [a, b])
    assert choose(router, [a, b])[0] == [["b"]]  # another replica's report does not lift a's mark
    clock.now += 1
    a.report()
    arrive(router, [a, b])
    assert choose(router, [a, b])[0] == [["a"], ["b"]]
    replica_health.mark_unavailable("a")
    replica_health.mark_unavailable("b")
    assert choose(router, [a, b])[0] == [["a", "b"]]  # every replica dead: tried anyway


def names(state: dict[ReplicaID, Any]) -> set[str]:
    return {replica_id.unique_id for replica_id in state}


def test_state_of_replicas_that_left_is_dropped(router, clock):
    a, b, c = FakeReplica("a", 0.0), FakeReplica("b", 0.0), FakeReplica("c", 0.0)
    for replica in (a, b, c):
        replica.report()
    arrive(router, [a, b, c])
    retried = pending()
    for replica in (a, b, c):
        choose(router, [replica], retried if replica is a else None)
    assert names(router._sends) == names(router._received) == {"a", "b", "c"}
    arrive(router, [b, c])
    assert names(router._sends) == names(router._received) == {"b", "c"}
    arrive(router, [b])
    assert names(router._sends) == names(router._received) == {"b"}
    choose(router, [b], retried)  # routed again: moving its count off a resurrects nothing
    assert names(router._sends) == names(router._received) == {"b"}


def test_a_replica_found_dead_is_not_fresh_again_when_a_broadcast_brings_it_back(router, clock):
    """Ray drops a replica whose actor died (on_replica_actor_died) and the next broadcast may
    list it again until the controller notices: its last report keeps its age (it goes stale)."""
    a, b = FakeReplica("a", 0.0), FakeReplica("b", 0.0)
    a.report()
    b.report()
    arrive(router, [a, b])
    clock.now += STALE_AFTER_S + 1
    b.report()
    router.on_replica_actor_died(a.replica_id)
    arrive(router, [a, b])
    assert choose(router, [a, b])[0] == [["b"], ["a"]]  # a is stale, tried after b


def test_replica_reporter_keeps_the_highest_pick_of_the_routers_heard_from_last():
    reporter = ReplicaReporter()
    for router_id, pick in [("r1", 3), ("r1", 1), ("r2", 7), ("r1", 4)]:
        reporter.arrived(EngineRequest("x", SamplingParams(), [1], router_pick=(router_id, pick)))
    reporter.arrived(EngineRequest("y", SamplingParams(), [1]))  # from another request router: ignored
    first, second = reporter.report(dict), reporter.report(dict)
    assert first == ReplicaReport(seq=1, router_picks={"r2": 7, "r1": 4}).to_dict() and second["seq"] == 2
    assert list(first["router_picks"]) == ["r2", "r1"]  # least recently heard from first
    for i in range(MAX_ROUTERS):
        reporter.arrived(EngineRequest("z", SamplingParams(), [1], router_pick=(f"n{i}", 1)))
    reporter.arrived(EngineRequest("x", SamplingParams(), [1], router_pick=("n0", 2)))
    picks = ReplicaReport.from_dict(reporter.report(dict)).router_picks
    assert len(picks) == MAX_ROUTERS and "r1" not in picks and "r2" not in picks and picks["n0"] == 2
