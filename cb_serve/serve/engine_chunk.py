"""What an engine replica streams to the router: per engine step, one ``EngineChunk`` per completion that
advanced. Plain data (no tensors, no engine objects) crosses the Ray boundary; every HTTP API builds its
bodies from these chunks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cb_serve import CompletionOutput, Logprob, RequestOutput

# Per token: {"token": its text, "logprob": its logprob, "top": [(text, logprob), ...] best first}
TokenLogprob = dict[str, Any]
# Per prompt token: None (the first) or {token_id: (logprob, rank, text)}
PromptLogprobs = list[dict[int, tuple[float, int, str]] | None]


@dataclass(frozen=True)
class EngineChunk:
    """One completion's progress in one engine step: the text and tokens it added, how it finished (on its
    last chunk), and what the request's bodies report beside it (usage, the replica, the prefix hit)."""

    index: int  # the completion (choice) index; the router shifts it for a list of prompts
    text: str
    num_tokens: int
    logprobs: list[TokenLogprob] | None  # None: not asked for
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    expected_cached_tokens: int | None  # what the request router expected of this replica (None: no report)
    replica: str
    timeline: dict[str, Any] | None = None  # the request's timeline, on its last chunk when asked for
    prompt_logprobs: PromptLogprobs | None = None

    def __post_init__(self) -> None:
        assert self.index >= 0 and self.num_tokens >= 0 and self.prompt_tokens >= 0, self

    @classmethod
    def of(
        cls,
        out: RequestOutput,
        completion: CompletionOutput,
        replica: str,
        expected_cached_tokens: int | None,
        timeline: dict[str, Any] | None = None,
    ) -> EngineChunk:
        """``completion``'s part of the engine output ``out``."""
        return cls(
            index=completion.index,
            text=completion.text,
            num_tokens=len(completion.token_ids),
            logprobs=token_logprobs(completion.token_ids, completion.logprobs),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_tokens=len(out.prompt_token_ids),
            cached_tokens=out.num_cached_tokens,
            expected_cached_tokens=expected_cached_tokens,
            replica=replica,
            timeline=timeline,
            prompt_logprobs=prompt_logprobs(out),
        )

    def replace(self, **changes: Any) -> EngineChunk:
        return dataclasses.replace(self, **changes)


def token_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | None) -> list[TokenLogprob] | None:
    """Per token: its text, its logprob and the alternatives (text, logprob), best first."""
    if entries is None:
        return None
    return [
        {
            "token": entry[tok].decoded_token,
            "logprob": entry[tok].logprob,
            "top": [(lp.decoded_token, lp.logprob) for lp in sorted(entry.values(), key=lambda lp: -lp.logprob)],
        }
        for tok, entry in zip(token_ids, entries)
    ]


def prompt_logprobs(out: RequestOutput) -> PromptLogprobs | None:
    """A request's prompt logprobs as plain data (None where not asked for, or already sent)."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()}
            for e in out.prompt_logprobs]  # fmt: skip
