"""``EngineCoreOutput``: what one step did to one sequence, as the engine thread hands it over (vLLM
v1's record of the same name). Token ids, their logprobs and times, and why the sequence ended: no
text. The front end (``output_processor.py``) detokenizes, looks for stop strings and makes the
``RequestOutput`` a client sees, off the engine thread.

The engine decides every stop that needs no text: stop token ids and EOS (after ``min_tokens``),
``max_tokens``, the context length, a complete grammar. A stop string is the front end's call: it ends
the sequence at that token, drops any token the engine made after it, and tells the engine
(``EngineCore.stop_sequence``), which frees the sequence's blocks at its next chance.
"""

from __future__ import annotations

from dataclasses import dataclass

from cb_serve.errors import EngineError
from cb_serve.outputs import Logprob

PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    index: int  # which of the request's ``n`` sequences
    new_token_ids: list[int]
    # per new token: its top-k and its own logprob (None: a token a grammar forced); None when the
    # request asked for no logprobs
    new_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None  # the sequence's: "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id that ended it (None: EOS or a complete grammar)
    request_finished: bool = False  # every sequence of the request has ended: the engine let it go
    time: float = 0.0  # when its tokens were appended (and the sequence finished, if it did)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    new_prompt_logprobs: PromptLogprobs | None = None  # entries computed by this step (the first sequence's)
    error: EngineError | None = None  # the request failed: this ends it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def by_request(records: list[EngineCoreOutput]) -> dict[str, list[EngineCoreOutput]]:
    """A step's records grouped by request, in the order of each request's first record."""
    groups: dict[str, list[EngineCoreOutput]] = {}
    for rec in records:
        group = groups.get(rec.request_id)
        if group is None:
            groups[rec.request_id] = [rec]
        else:
            group.append(rec)
    return groups
