"""``speculative_config``, as vLLM spells it: ``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": a, "prompt_lookup_max": b}`` or ``{"method": "draft_model", "model": ...,
"num_speculative_tokens": k}`` or ``{"method": "mtp", "num_speculative_tokens": k}`` (the checkpoint's own
multi-token-prediction layers: Qwen3-Next, Qwen3.5), each with ``"adaptive": true`` (the default: ``k`` is the most a
sequence drafts, the policy picks fewer or none by load and acceptance) or ``false`` (always ``k``
when the proposer finds them, as vLLM)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model (method draft_model); it must share the target's tokenizer
    adaptive: bool = True  # drafts only where they raise expected tokens per second (spec_decode.policy)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}.")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}."
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(
                f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {low}, {high}."
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}.")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model is the draft model of method draft_model, and only of it.")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"Unknown speculative_config key(s): {', '.join(unknown)}. Known: {', '.join(sorted(known))}."
            )
        if "method" not in options or "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs method and num_speculative_tokens.")
        return cls(**options)
