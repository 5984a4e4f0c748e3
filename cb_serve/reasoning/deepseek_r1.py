"""``deepseek_r1``: DeepSeek-R1 and its distills (QwQ too, in vLLM's table).

R1's chat template ends the generation prompt with ``<think>\\n``, so the output starts inside the
reasoning and usually never shows ``<think>``; a ``<think>`` it does emit is dropped, text up to
``</think>`` is reasoning, and an output without ``</think>`` (cut by max_tokens) is all reasoning
(vLLM's ``DeepSeekR1ReasoningParser``). A prompt whose last think tag is ``</think>`` (the reasoning
already closed, e.g. a continued final message) makes the output content from the start, as vLLM's
serving layer does with ``prompt_is_reasoning_end``.
"""

from __future__ import annotations

from collections.abc import Sequence

from cb_serve.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """R1 always reasons first: only a prompt that already closed the block starts in the content."""
        return self.last_tag(prompt_token_ids) != self.think_end_id
