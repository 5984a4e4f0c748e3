"""The engine replica's side of its routing report (see ``request_router``): report numbers,
and the request routers' picks that reached the replica, so a router counts the requests a
report cannot know yet without comparing clocks across machines."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cb_serve.serve.engine_request import EngineRequest

MAX_ROUTERS = 64  # request routers a replica reports picks for (least recently heard from forgotten first)


@dataclass(frozen=True)
class ReplicaReport:
    """An engine replica's routing report (Ray Serve carries it as the dict ``to_dict`` makes, from
    ``EngineReplica.record_routing_stats`` to every request router). A field a report lacks (no
    report yet, or an older replica) has its default."""

    seq: int | None = None  # numbers the replica's reports
    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    # Requests, not sequences (n > 1 makes several), counting those still in the engine's inbox
    # (None: running + waiting).
    num_requests: int | None = None
    token_budget: int = 1
    max_num_seqs: int = 1
    alive: bool = True  # False: the router skips this replica at once
    prefix_cache: dict[str, Any] | None = None  # what its prefix cache holds (``PrefixDigest.to_dict``)
    lora_adapters: tuple[int, ...] = ()  # lora_int_ids held (adapter-aware routing)
    router_picks: dict[str, int] = field(default_factory=dict)  # router id -> highest pick received
    time: float | None = None  # for people reading it; a router ages a report by its own clock

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, stats: dict[str, Any] | None) -> ReplicaReport:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in (stats or {}).items() if k in known}
        if "lora_adapters" in values:
            values["lora_adapters"] = tuple(values["lora_adapters"] or ())
        return cls(**values)

    @property
    def number(self) -> Any:
        """What tells a replica's reports apart (None: no report). Only compared for equality: a
        replica without ``seq`` (an older version) is told apart by its ``time``."""
        return self.seq if self.seq is not None else self.time

    @property
    def requests(self) -> int:
        return self.num_requests if self.num_requests is not None else self.num_running + self.num_waiting


class ReplicaReporter:
    """An engine replica's side of the routing report: numbers its reports (``seq``), and keeps,
    per request router (the ``MAX_ROUTERS`` heard from most recently), the highest pick number
    that reached it (``router_picks``). Safe to call from the replica's event loop and from the
    thread Ray Serve runs ``record_routing_stats`` in."""

    def __init__(self) -> None:
        self.seq = 0
        self.router_picks: dict[str, int] = {}  # router id -> highest pick; least recently heard from first
        self._lock = threading.Lock()

    def arrived(self, request: EngineRequest) -> None:
        """Counts ``request`` as received; called after the replica counts it in ``num_requests``,
        so no report leaves it out of both."""
        if request.router_pick is None:
            return
        router_id, pick = request.router_pick
        with self._lock:
            self.router_picks[router_id] = max(pick, self.router_picks.pop(router_id, pick))
            if len(self.router_picks) > MAX_ROUTERS:
                del self.router_picks[next(iter(self.router_picks))]

    def report(self, load: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The next report, numbered, with the picks received so far and then ``load()``
        (``ReplicaReport``'s other fields), as the dict Ray Serve carries. The picks first: a
        request arriving meanwhile is then counted twice until the next report (in the load and as
        sent since), never nowhere (``arrived`` follows the replica's count)."""
        with self._lock:
            self.seq += 1
            seq, picks = self.seq, dict(self.router_picks)
        return ReplicaReport(seq=seq, router_picks=picks, **load()).to_dict()
