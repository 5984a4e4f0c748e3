"""Engine replicas this process found unavailable (their engine dead or shutting down).

The ingress marks a replica when one of its requests fails that way; the request router
(``request_router.KVCacheAwareRouter``) skips it from the next pick, until a routing report
that arrived after the mark. The marks live in this module, imported by reference by both (Ray
may rebuild the request router class from a pickled copy with its own globals). Marks and
report arrivals are stamped with ``clock``, this process's monotonic clock: never compared
with a time from another machine.
"""

from __future__ import annotations

import time

MARK_TTL_S = 60.0  # a dead replica is replaced under a new id long before this
_marked: dict[str, float] = {}  # replica unique id -> when it was found unavailable (clock)


def clock() -> float:
    """This process's clock for marks and for when routing reports arrive (monotonic)."""
    return time.monotonic()


def mark_unavailable(replica_unique_id: str) -> None:
    now = clock()
    _marked[replica_unique_id] = now
    for rid in [r for r, t in _marked.items() if now - t > MARK_TTL_S]:
        del _marked[rid]


def marked_after(replica_unique_id: str, received: float | None) -> bool:
    """Whether the replica was marked unavailable after its routing report arrived here at
    ``received`` (``clock``; None: no report yet)."""
    marked = _marked.get(replica_unique_id)
    return marked is not None and (received is None or received <= marked)
