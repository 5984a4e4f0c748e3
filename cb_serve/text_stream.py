"""What parsers of streamed text share: how much of a text's end to hold back, because a marker may begin there
and the next chunk may complete it (reasoning splitters, tool-call parsers, Harmony)."""

from __future__ import annotations

from collections.abc import Iterable


def held_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``markers``."""
    markers = tuple(markers)
    for n in range(min(len(text), max((len(m) for m in markers), default=1) - 1), 0, -1):
        end = text[-n:]
        if any(m.startswith(end) for m in markers):
            return n
    return 0
