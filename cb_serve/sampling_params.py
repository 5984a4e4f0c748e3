"""Per-request sampling parameters (vLLM-compatible names and defaults)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from cb_serve.errors import InvalidRequestError
from cb_serve.structured_outputs_params import StructuredOutputsParams

# torch.Generator.manual_seed takes [-2**63, 2**64 - 1].
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# Below this temperature sampling is greedy (as in vLLM): dividing logits by it overflows.
MIN_TEMPERATURE = 1e-5


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text / tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one prompt.

    ``temperature == 0`` (or below 1e-5) means greedy. ``top_k`` of 0 or -1 (or at least the
    vocabulary size) and ``top_p == 1`` disable those filters. ``logprobs=k`` returns the top-k log-probabilities
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
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)
    # Filled in by the engine from the tokenizer; not a user knob.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        check(is_int(self.n) and self.n >= 1, "n", f"n must be at least 1, got {self.n}.")
        temperature_ok = is_real(self.temperature) and self.temperature >= 0.0
        check(temperature_ok, "temperature", f"temperature must be a non-negative number, got {self.temperature}.")
        check(is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        top_k_ok = is_int(self.top_k) and self.top_k >= -1
        check(top_k_ok, "top_k", f"top_k must be -1 (disable) or a positive integer, got {self.top_k}.")
        check(is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        seed_ok = self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX)
        check(seed_ok, "seed", f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}.")
        max_ok = self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1)
        check(max_ok, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        min_ok = is_int(self.min_tokens) and self.min_tokens >= 0
        check(min_ok, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}.")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
        )
        logprobs_ok = self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0)
        check(logprobs_ok, "logprobs", f"logprobs must be a non-negative integer, got {self.logprobs}.")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings.")
        ids_ok = all(is_int(t) and t >= 0 for t in self.stop_token_ids)
        check(ids_ok, "stop_token_ids", "stop_token_ids must be non-negative integers.")
        so_ok = self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams)
        check(so_ok, "structured_outputs", "structured_outputs must be a StructuredOutputsParams.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of parallel sample ``index`` of an ``n > 1`` request."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > SEED_MAX:
            seed -= 1 << 64  # torch maps a negative seed s to 2**64 - 1 + s
        return replace(self, n=1, seed=seed)
