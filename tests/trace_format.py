"""The trace-event format's rules (Chrome / Perfetto), checked on an exported trace."""

from __future__ import annotations

import json
from collections import Counter, defaultdict


def validate_trace(events: list[dict]) -> None:
    """The trace-event format's rules that Perfetto and chrome://tracing rely on."""
    json.dumps({"traceEvents": events})  # serializable as is
    phases = Counter()
    stacks: dict[tuple, list] = defaultdict(list)
    for e in events:
        assert {"name", "ph", "pid"} <= e.keys(), e
        assert e["ph"] in {"X", "b", "e", "n", "M", "C"}, e
        phases[e["ph"]] += 1
        if e["ph"] != "M":
            assert isinstance(e["ts"], int) and e["ts"] > 0, e
        if e["ph"] == "X":
            assert e["dur"] > 0 and "tid" in e
        if e["ph"] in "ben":
            assert e["cat"] and e["id"], e
    for e in sorted((e for e in events if e["ph"] in "be"), key=lambda e: e["ts"]):  # stable: file order in ties
        key = (e["pid"], e["cat"], e["id"], e["name"])
        if e["ph"] == "b":
            stacks[key].append(e["ts"])
        else:
            assert stacks[key], f"end without begin: {e}"
            assert stacks[key].pop() <= e["ts"]
    assert not any(stacks.values()), "begin without end"
    assert phases["X"] and phases["b"] == phases["e"]
