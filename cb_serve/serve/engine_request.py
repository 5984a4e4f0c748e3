"""What the HTTP router sends an engine replica for one request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cb_serve import LoRARequest, MultiModalFeature, SamplingParams


@dataclass
class EngineRequest:
    """One generation request, tokenized once by the router (chat template applied).

    ``block_hashes`` are the prompt's ``prefix_block_hashes`` (concatenated 32-byte hashes for
    ``block_size``), which the request router matches against each replica's prefix-cache
    digest. ``prompt`` keeps the client's input for request routers that read text, such as
    Ray Serve LLM's ``PrefixCacheAffinityRouter`` (which looks for a ``prompt`` or ``messages``
    attribute).
    """

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    block_size: int = 0
    block_hashes: bytes = b""
    session_id: str | None = None
    prompt: str | list[int] | None = None
    # Set by the request router: the prefix-hit tokens it expected of each replica with a fresh report.
    expected_hit_tokens: dict[str, int] | None = None
    # Set by the request router: its id and pick number, reported back by the replica (ReplicaReporter).
    router_pick: tuple[str, int] | None = None
    return_timeline: bool = False  # the final chunk carries the request's timeline
    lora_request: LoRARequest | None = None  # the adapter named by the ``model`` field (None: the base model)
    priority: int = 0  # the engine's scheduling_policy "priority" orders by it (lower first)
    # The prompt's images as the router processed them (their placeholders already expanded in the ids)
    mm_features: tuple[MultiModalFeature, ...] = ()

    def engine_prompt(self) -> list[int] | dict[str, Any]:
        """What ``AsyncLLM.generate`` takes: the token ids, with their images where there are some."""
        if not self.mm_features:
            return self.prompt_token_ids
        return {"prompt_token_ids": self.prompt_token_ids, "multi_modal_features": self.mm_features}

    def __post_init__(self) -> None:
        assert len(self.block_hashes) % 32 == 0 and (self.block_size > 0 or not self.block_hashes)


@dataclass
class ChatEngineRequest(EngineRequest):
    """A chat request: ``messages`` are the conversation the token ids were rendered from."""

    messages: list[dict[str, Any]] | None = None


@dataclass
class InspectRequest:
    """A batch-inspector view (``AsyncLLM.inspect``) of one replica: ``KVCacheAwareRouter``
    sends it to ``target_replica`` (another request router may not; the answer names its replica)."""

    view: str
    kwargs: dict[str, Any]
    target_replica: str | None = None
