"""``ReasoningParser``: where a reasoning model's thinking (between ``<think>`` and ``</think>``)
ends, at the token level for the engine and at the text level for the HTTP layer (vLLM's
``--reasoning-parser``).

The rule, the same at both levels: the last think tag decides. The output starts in the reasoning
unless the prompt's last think tag is ``</think>`` (a template that turned thinking off puts an
empty ``<think>\\n\\n</think>\\n\\n`` in the prompt; a prompt without any tag starts in the
reasoning: the model opens it itself, or its template opened it). Earlier turns' closed blocks do
not count once the generation prompt opens a new one (but a history block kept by a template
whose generation prompt opens none, as Qwen3's first templates in a tool loop, reads as closed:
vLLM's ``is_reasoning_end`` does the same). In the output, the first ``</think>`` ends the
reasoning; a ``<think>`` inside the reasoning is dropped from the text. The text level matches the
tags in the text, the token level their token ids: they agree unless a model spells a tag out of
ordinary tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from cb_serve.reasoning.splitter import ReasoningSplitter


class ReasoningParser(ABC):
    """One per engine (stateless): the think tokens' ids and the rule above. Raises ``ValueError``
    when the tokenizer has no single token for either tag (as vLLM does: not a reasoning model)."""

    name: ClassVar[str]
    tags_are_tokens: ClassVar[bool] = True  # the think tags are single tokens (Granite's markers are text)
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        start, end = vocab.get(self.start_tag), vocab.get(self.end_tag)
        if start is None or end is None:
            missing = " and ".join(t for t, i in ((self.start_tag, start), (self.end_tag, end)) if i is None)
            raise ValueError(
                f"reasoning_parser {self.name!r} needs the tokens {self.start_tag} and {self.end_tag}, "
                f"and this model's tokenizer has no {missing} token: it is not a reasoning model this parser knows."
            )
        self.think_start_id: int = start
        self.think_end_id: int = end

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The tokens that end the reasoning (the engine's grammars start after them)."""
        return (self.think_end_id,)

    def last_tag(self, token_ids: Sequence[int]) -> int | None:
        """The last think tag's id among ``token_ids`` (None: no tag); scans from the end."""
        for token_id in reversed(token_ids):
            if token_id == self.think_start_id or token_id == self.think_end_id:
                return token_id
        return None

    @abstractmethod
    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the output of this prompt begins inside the reasoning."""

    def reasoning_ended(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> bool:
        """vLLM's ``is_reasoning_end`` over prompt + output: the reasoning has ended iff the last
        think tag is ``</think>``, where no tag at all counts as ``starts_in_reasoning`` says. (The
        engine tracks it per token, from the first ``</think>`` on: see ``StructuredOutputManager``.)"""
        last = self.last_tag(output_token_ids)
        if last is not None:
            return last == self.think_end_id
        return not self.starts_in_reasoning(prompt_token_ids)

    def splitter(self, prompt_token_ids: Sequence[int]) -> ReasoningSplitter:
        """A streaming splitter for one output of this prompt."""
        return ReasoningSplitter(self.start_tag, self.end_tag, self.starts_in_reasoning(prompt_token_ids))

    def split(self, text: str, prompt_token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        """A whole output's text as (reasoning, content), None for an empty part."""
        return self.splitter(prompt_token_ids).split(text)
