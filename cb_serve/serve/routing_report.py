"""The engine replica's side of its routing report (see ``request_router``): report numbers,
and the request routers' picks that reached the replica, so a router counts the requests a
report cannot know yet without comparing clocks across machines."""

from __future__ import annotations

import threading
from typing import Any

from cb_serve.serve.engine_request import EngineRequest

MAX_ROUTERS = 64  # request routers a replica reports picks for (least recently heard from forgotten first)


def report_number(stats: dict[str, Any]) -> Any:
    """What tells a replica's reports apart (None: no report). Only compared for equality: a
    replica without ``seq`` (an older version) is told apart by its ``time``."""
    return stats.get("seq", stats.get("time"))


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

    def report(self) -> dict[str, Any]:
        """The next report's number and the picks received so far."""
        with self._lock:
            self.seq += 1
            return {"seq": self.seq, "router_picks": dict(self.router_picks)}
