"""Real faults on demand, for the fault tests: engine argument ``fault_injection`` or the
environment variable ``CB_SERVE_FAULT_INJECTION``.

A spec is a comma-separated list of ``KIND:WHEN`` rules. ``WHEN`` is either text that the
request's prompt contains, or ``#N`` for the engine's N-th step (counted from 1). Kinds:

- ``request``: the matching request fails while its output is processed (like a
  detokenizer error): only that request fails.
- ``step``: the step holding a matching request (or step N) raises before the model runs,
  like a kernel error: the step's requests fail with a retryable error, the engine goes on.
- ``fatal``: the same step raises ``EngineFatalError``: the engine loop stops and the
  replica reports itself dead.
- ``slow``: the step holding a matching request (or step N) takes ``SLOW_STEP_S`` longer,
  like a slow device: streams that outlast a kill, a node loss or a shutdown.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from cb_serve.errors import EngineFatalError

ENV_VAR = "CB_SERVE_FAULT_INJECTION"
KINDS = ("request", "step", "fatal", "slow")
SLOW_STEP_S = 0.1


class InjectedFault(RuntimeError):
    """A fault raised on purpose (``fault_injection``)."""


@dataclass(frozen=True)
class FaultRule:
    kind: str
    text: str | None = None
    step: int | None = None

    @classmethod
    def parse(cls, rule: str) -> FaultRule:
        kind, sep, when = rule.strip().partition(":")
        if kind not in KINDS or not sep or not when:
            raise ValueError(f"fault_injection rule {rule!r}: expected KIND:WHEN with KIND one of {', '.join(KINDS)}.")
        if when.startswith("#"):
            if kind == "request" or not when[1:].isdigit() or int(when[1:]) < 1:
                raise ValueError(f"fault_injection rule {rule!r}: #N (N >= 1) is for step and fatal rules.")
            return cls(kind, step=int(when[1:]))
        return cls(kind, text=when)


class FaultInjector:
    def __init__(self, spec: str) -> None:
        self.rules = [FaultRule.parse(r) for r in spec.split(",") if r.strip()]
        if not self.rules:
            raise ValueError("fault_injection is empty.")

    @classmethod
    def from_config(cls, spec: str | None) -> FaultInjector | None:
        spec = spec if spec is not None else os.environ.get(ENV_VAR)
        return cls(spec) if spec else None

    def kinds_for_prompt(self, prompt_text: str) -> frozenset[str]:
        """The fault kinds a request with this prompt carries."""
        return frozenset(r.kind for r in self.rules if r.text is not None and r.text in prompt_text)

    def before_step(self, step_number: int, kinds_in_step: set[str]) -> None:
        """Raises the fault this step is due, if any (or sleeps, for ``slow``)."""
        kinds = set(kinds_in_step) | {r.kind for r in self.rules if r.step == step_number}
        if "slow" in kinds:
            time.sleep(SLOW_STEP_S)
        if "fatal" in kinds:
            raise EngineFatalError(f"injected fatal fault (step {step_number})")
        if "step" in kinds:
            raise InjectedFault(f"injected step fault (step {step_number})")

    @staticmethod
    def before_output(kinds: frozenset[str]) -> None:
        if "request" in kinds:
            raise InjectedFault("injected request fault")
