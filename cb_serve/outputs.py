"""What the engine returns (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass

from cb_serve.errors import EngineError
from cb_serve.lora_request import LoRARequest


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class Logprob:
    """One token's log probability, its rank in the vocabulary (1 = most likely) and its text (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the top-k tokens and the sampled one
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    error: EngineError | None = None  # set when the request failed (its completions end with "error")
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's field)
    # ``prompt_logprobs``: per prompt token, None for the first, else its top-k and its own logprob
    # (vLLM's shape); in the request's first output (every CUMULATIVE / FINAL_ONLY one)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
