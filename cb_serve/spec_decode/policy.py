"""How many drafts each sequence carries this step: the adaptive policy (``adaptive: true``).

A step's value is the tokens it emits; its cost is its time. A draft adds the probability that it
and every draft before it are accepted in expected tokens, and one query token. The policy ranks
every proposed draft by that gain and keeps the prefix of the ranking that maximizes

    expected emitted tokens / step seconds(scheduled tokens),

with both factors measured, not assumed:

- ``StepCostCurve``: decode step seconds as a function of the step's scheduled tokens, from the
  engine's own recent steps (drafts can cost more than decodes: several query tokens of a sequence
  take the chunked attention path, and each is verified). On a bandwidth-bound step (few
  sequences) one more query token costs almost nothing and every plausible draft is kept; on a
  compute-bound step (many sequences) a draft must be nearly certain to pay for itself, and
  usually none is kept (``k = 0``).
- ``AcceptanceEstimate``: the first draft's acceptance per sequence, shrunk toward the engine-wide
  rate (a new sequence starts there) and forgotten geometrically, so a sequence whose text starts or
  stops copying is followed within a few steps; each later position's acceptance given the one
  before it, engine-wide (not a power of the first: a draft that starts right tends to go on right,
  as a copied passage does).
- **Probes.** A sequence that keeps no drafts is not measured, so its estimate would never change: one
  whose text starts repeating later (a weak model's loop, a passage it begins to quote) would never be
  drafted for again. A sequence that has proposals but keeps none for ``PROBE_FIRST`` steps keeps one
  draft (a probe); each rejected one doubles the wait (to ``PROBE_MAX``), an accepted one resets it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BUCKETS_PER_OCTAVE = 4


class StepCostCurve:
    """Decode step seconds by scheduled tokens (decodes and drafts; a step with a prompt chunk costs
    what its chunk costs and is not observed): an exponentially weighted mean of (tokens, seconds)
    per quarter octave of tokens, joined piecewise linearly. Beyond the largest measured bucket it
    stays flat: a larger step looks free until it is tried once, and is known from then on (a
    curve that guessed high would never be corrected: the policy would never draft to measure it)."""

    def __init__(self, decay: float = 0.8) -> None:
        assert 0 < decay < 1
        self.decay = decay
        self.points: dict[int, tuple[float, float]] = {}  # bucket -> (mean tokens, mean seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        bucket = round(BUCKETS_PER_OCTAVE * math.log2(num_tokens))
        old = self.points.get(bucket)
        if old is None:
            self.points[bucket] = (float(num_tokens), seconds)
        else:
            d = self.decay
            self.points[bucket] = (d * old[0] + (1 - d) * num_tokens, d * old[1] + (1 - d) * seconds)

    def seconds(self, num_tokens: np.ndarray) -> np.ndarray | None:
        """The expected step time at each of ``num_tokens`` (None before any step was measured)."""
        if not self.points:
            return None
        n, t = (np.array(v) for v in zip(*sorted(self.points.values())))
        return np.interp(np.asarray(num_tokens, dtype=np.float64), n, t)  # flat beyond the ends


@dataclass
class AcceptanceEstimate:
    """One acceptance probability: decayed accepted drafts and trials, shrunk toward a prior."""

    accepted: float = 0.0
    trials: float = 0.0

    def record(self, accepted: bool, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.trials = decay * self.trials + 1.0

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior * prior_weight) / (self.trials + prior_weight)


SEQ_DECAY = 0.7  # a sequence's own evidence halves in about two verified steps
ENGINE_DECAY = 0.99
PRIOR = 0.7  # before anything is measured
PRIOR_WEIGHT = 2.0  # a prior counts as this many trials
# A draft is priced at this multiple of its measured marginal cost: the curve's points come from
# other steps (other batches, other context lengths), so a draft that only breaks even by it is left
# out; where drafts pay (a bandwidth-bound step) their marginal cost is near zero either way.
DRAFT_COST_MARGIN = 2.0
PROBE_FIRST = 4  # steps with proposals but no kept drafts before a sequence probes with one
PROBE_MAX = 256


def draft_gains(first_rate: float, later_rates: list[float], k: int) -> list[float]:
    """Expected emitted tokens of each of ``k`` drafts: the first accepted with ``first_rate``, the
    ``j``-th (j > 1) with ``later_rates[j - 2]`` once the one before it was accepted."""
    gains = [first_rate]
    for rate in later_rates[: k - 1]:
        gains.append(gains[-1] * rate)
    return gains[:k]


def choose_num_drafts(
    gains: list[list[float]], base_tokens: int, base_emitted: float, curve: StepCostCurve
) -> list[int]:
    """How many drafts to keep of each sequence's proposed ones (``gains[i]``: the expected tokens of
    each, nonincreasing), given the step's ``base_tokens`` scheduled tokens and ``base_emitted``
    tokens it emits without drafts: the prefix of all drafts ranked by gain with the most expected
    tokens per second (the first of equals: fewer drafts), drafts priced at ``DRAFT_COST_MARGIN``
    times their measured cost."""
    ranked = sorted(((g, i) for i, seq_gains in enumerate(gains) for g in seq_gains), reverse=True)
    seconds = curve.seconds(base_tokens + np.arange(len(ranked) + 1))
    if seconds is None:
        return [len(g) for g in gains]  # nothing measured yet: speculate, and measure
    seconds = seconds[0] + DRAFT_COST_MARGIN * (seconds - seconds[0])
    emitted = base_emitted + np.cumsum([0.0] + [g for g, _ in ranked])
    best_len = int(np.argmax(emitted / seconds))
    keep = [0] * len(gains)
    for _, i in ranked[:best_len]:
        keep[i] += 1  # a sequence's drafts rank in position order, so these are its first ``keep[i]``
    return keep
