"""Mutation score per module from a finished ``mutmut run`` (``make mutation``): reads mutmut's
``mutants/<path>.meta`` files; prints killed / survived / other per module, the score (killed over
all mutants that were tested), and the surviving mutants' names (``mutmut show NAME`` shows one)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import tomllib

# mutmut's exit codes (mutmut.stats.status_by_exit_code); anything else counts as "other".
KILLED = {1, 3, 37}
SURVIVED = {0}
TIMEOUT = {24, -24, 36, 152, 255}


def modules() -> list[str]:
    config = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["mutmut"]
    return config["only_mutate"]


def main() -> int:
    total: Counter[str] = Counter()
    survivors: list[str] = []
    for module in modules():
        meta = Path("mutants") / f"{module}.meta"
        if not meta.exists():
            print(f"{module}: no results (run `make mutation`)")
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        counts = Counter(
            "killed" if c in KILLED else "survived" if c in SURVIVED else "timeout" if c in TIMEOUT else "other"
            for c in codes.values()
        )
        survivors += sorted(k for k, c in codes.items() if c in SURVIVED)
        tested = counts["killed"] + counts["survived"] + counts["timeout"]
        score = (counts["killed"] + counts["timeout"]) / tested if tested else 0.0
        print(f"{module}: {len(codes)} mutants, {dict(counts)}, score {score:.1%}")
        total += counts
    tested = total["killed"] + total["survived"] + total["timeout"]
    if tested:
        print(f"all: {sum(total.values())} mutants, {dict(total)}, score {(tested - total['survived']) / tested:.1%}")
    print("\n".join(["surviving mutants:", *survivors]) if survivors else "no surviving mutants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
