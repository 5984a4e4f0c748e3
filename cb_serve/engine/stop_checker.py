"""The one place that decides when a sequence stops: stop token ids, EOS, ``min_tokens``,
stop strings, ``max_tokens`` and the context length. The engine asks it after every token; its
``stop_ids`` are what a ``Sequence`` bans from sampling before ``min_tokens``.

Per token the cost is O(new text): a stop string can only end inside the characters the
token added, so each one is looked for in those characters plus its own length - 1 before
them, never in the whole output, and never in other sequences' stops.
"""

from __future__ import annotations

from typing import Protocol

from cb_serve.sampling_params import SamplingParams

# (finish reason, stop reason): ("stop", the stop string / stop token id / None for EOS) or ("length", None)
StopDecision = tuple[str, int | str | None]


class TextSink(Protocol):
    """What the checker needs of a detokenizer (``IncrementalDetokenizer``)."""

    text: str

    def append(self, token_id: int) -> int: ...

    def truncate(self, length: int) -> None: ...


class StopChecker:
    """Stop conditions of one request's parameters (shared by its ``n`` sequences: it keeps no
    per-sequence state)."""

    def __init__(self, params: SamplingParams) -> None:
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.stop_ids = self.stop_token_ids | (frozenset() if params.ignore_eos else params.eos_token_ids)
        self.min_tokens = params.min_tokens
        self.stop_strings = tuple(params.stop)
        self.include_stop_str = params.include_stop_str_in_output
        # Characters of a running sequence's text not streamed yet: they may begin a stop string.
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1

    def update(
        self, token_id: int, num_output_tokens: int, at_limit: bool, detok: TextSink | None
    ) -> StopDecision | None:
        """Called once a token is appended: feeds it to ``detok`` (unless a stop token ends the
        sequence and is not shown) and returns why the sequence stops, or None. ``at_limit``:
        the sequence reached ``max_tokens`` or the context length."""
        may_stop = num_output_tokens >= self.min_tokens
        decision: StopDecision | None = None
        if may_stop and token_id in self.stop_ids:
            decision = ("stop", token_id if token_id in self.stop_token_ids else None)
        if detok is not None and (decision is None or self.include_stop_str):
            num_new = detok.append(token_id)
            if decision is None and may_stop and num_new:
                decision = self._find_stop_string(detok, num_new)
        if decision is None and at_limit:
            decision = ("length", None)
        return decision

    def _find_stop_string(self, detok: TextSink, num_new: int) -> StopDecision | None:
        """The stop string that ends earliest in the last ``num_new`` characters; cuts the text there."""
        text = detok.text
        new_start = len(text) - num_new
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            i = text.find(stop, max(0, new_start - len(stop) + 1))
            if i != -1 and (best is None or i + len(stop) < best[0] + len(best[1])):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        detok.truncate(i + (len(stop) if self.include_stop_str else 0))
        return ("stop", stop)
