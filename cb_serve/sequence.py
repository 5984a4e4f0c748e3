"""A sequence (a prompt and one of its completions) with its scheduling state, and the batch of
sequences one step computes: the types the engine and the model executor share."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from cb_serve.lora_request import LoRARequest
from cb_serve.outputs import Logprob
from cb_serve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    # Plain attributes of each member, set below (read for every sequence in every step: no hashing).
    is_finished: bool
    finish_reason: str | None  # the OpenAI finish reason of a finished status


for _status, _reason in (
    (SequenceStatus.WAITING, None),
    (SequenceStatus.RUNNING, None),
    (SequenceStatus.FINISHED_STOPPED, "stop"),
    (SequenceStatus.FINISHED_LENGTH, "length"),
    (SequenceStatus.FINISHED_ABORTED, "abort"),
    (SequenceStatus.FINISHED_ERROR, "error"),
):
    _status.finish_reason, _status.is_finished = _reason, _reason is not None


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class Sequence:
    """Token ids so far, how many of them have KV in the cache, and where that KV lives.

    vLLM v1 style: there is no prefill phase. Each step the scheduler hands a sequence
    ``num_tokens - num_computed_tokens`` new tokens (or fewer, under the budget); a
    sequence samples when it has caught up (``num_computed_tokens == num_tokens``).
    """

    def __init__(
        self,
        seq_id: int | str,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        min_tokens_banned: Iterable[int] = (),
        lora: LoRARequest | None = None,
        priority: int = 0,
        mm_features: tuple = (),
    ) -> None:
        assert prompt_token_ids, "empty prompts are rejected before a Sequence is made"
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.min_tokens_banned = sorted(min_tokens_banned)  # stop token ids and EOS
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight (async scheduling): their ids are on the device only.
        # A step scheduled meanwhile feeds the last of them back from there (``ModelRunner.prepare``).
        self.num_pending_tokens = 0
        self.last_step = 0  # async scheduling: the number of the last launched step that computes it
        self.state_slot = -1  # recurrent layers' state slot while running (engine/state_slots.py)
        self.num_cached_tokens = 0  # prefix-cache hit at the first scheduling
        # One per KV-cache group (``kv_cache_interface``). Only appended to in place; any other change
        # makes a new outer list (the model runner's rows, ``block_table_rows``, copy only what is new).
        self.block_tables: list[list[int]] = [[]]
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.matcher: Any = None  # its GrammarMatcher when the request constrains its output
        self.spec_token_ids: list[int] = []  # drafts the next step verifies (speculative decoding)
        self.spec_state: Any = None  # speculative decoding's own (``spec_decode.speculator.SeqSpecState``)
        self.lora = lora  # its adapter (None: the base model)
        self.priority = priority  # scheduling_policy "priority": lower first (vLLM's convention)
        self.mm_features = mm_features  # its images (``multimodal.MultiModalFeature``), in prompt order
        # prompt_logprobs: entry i is prompt token i's (None for the first), filled as its prefill chunks run
        self.prompt_logprobs: list[dict[int, Logprob] | None] = []
        self.lora_wait_steps = 0  # admissions it was passed over for lack of a slot (``lora.admission``'s fairness)
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed)
        self._device_generator: torch.Generator | None = None
        self.times = SequenceTimes() if arrival_time is None else SequenceTimes(arrival=arrival_time)

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        """Its seeded generator on ``device``, where its draws are made: the CPU one, or one on the accelerator
        (made on first use, seeded alike; its draws differ from the CPU's, as in vLLM), so that no vocabulary-sized
        draw is made on the host and copied each step."""
        if self.generator is None or device.type == "cpu":
            return self.generator
        if self._device_generator is None:
            self._device_generator = torch.Generator(device).manual_seed(self.params.seed)
        return self._device_generator

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def block_table(self) -> list[int]:
        """The first KV-cache group's block table (every group's has this length)."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def output_token_ids_from(self, start: int) -> list[int]:
        """Output tokens from index ``start`` on (O(new tokens), for streaming)."""
        return self.token_ids[self.num_prompt_tokens + start :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens without KV yet, counting the pending ones (async scheduling) at their places."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    def finishes_when_pending_land(self, max_model_len: int) -> bool:
        """Its pending tokens reach ``max_tokens`` or the context length: no step needs to run it again."""
        n = len(self.token_ids) + self.num_pending_tokens
        return n - self.num_prompt_tokens >= self.max_tokens or n >= max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and some are still to compute (the first of ``n`` samples computes
        them for the request); meanwhile the prefix cache is not read for it."""
        wanted = self.params.prompt_logprobs is not None and self.index == 0 and self.num_prompt_tokens > 1
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens

    def banned_token_ids(self) -> list[int]:
        """Token ids the sampler must not pick yet: stop tokens and EOS before ``min_tokens`` (a
        constrained sequence: none, its grammar decides where the output ends). A pending token (async
        scheduling) counts: the ban is of the token this step samples."""
        if self.matcher is not None:
            return []
        made = self.num_output_tokens + self.num_pending_tokens
        return self.min_tokens_banned if made < self.params.min_tokens else []

    def append_token(self, token_id: int, now: float, forced: bool = False) -> None:
        """A sampled token (the sequence caught up), or one its grammar ``forced`` after it (jump-forward)."""
        assert forced or self.num_computed_tokens >= self.num_tokens or self.status == SequenceStatus.WAITING, (
            "sample only after catching up (or, async scheduling, preempted since that step was launched)"
        )
        self.token_ids.append(token_id)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.last_token = now


@dataclass
class SchedulerOutput:
    """What one step computes: ``num_scheduled_tokens[i]`` new tokens of ``seqs[i]``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_admitted: int = 0  # the last ``num_admitted`` of ``seqs`` came from the waiting queue this step
    # The grammar's masks of the step's constrained sampling positions, being filled while the
    # forward pass runs (``StructuredOutputManager.grammar_bitmask``); None: no constrained row.
    grammar_bitmask: Any = None
    # A hybrid model's state copies (``engine.state_snapshots.StateCopies``): prefix hits' restores, saves
    state_copies: Any = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
