"""Per-request sampling parameters (vLLM-compatible names and defaults)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text / tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one prompt.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 and ``top_p == 1``
    disable those filters. ``logprobs=k`` returns the top-k log-probabilities
    (of the raw model distribution) for each generated token, plus the sampled one.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the engine from the tokenizer; not a user knob.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            f"top_k must be -1 (disable) or a positive integer, got {self.top_k}.",
        )
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be at least 1, got {self.max_tokens}.",
        )
        check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}.")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
        )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            f"logprobs must be a non-negative integer, got {self.logprobs}.",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings.")
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers.",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of parallel sample ``index`` of an ``n > 1`` request."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
