"""``qwen3``: the Qwen3 family (vLLM's current ``Qwen3ReasoningParser``).

Qwen3's first templates leave ``<|im_start|>assistant\\n`` open and the model writes ``<think>``
itself; Qwen3-Thinking-2507 and Qwen3.5 templates put ``<think>`` in the prompt, so only
``</think>`` appears in the output. Both ways, text before ``</think>`` is reasoning (a ``<think>``
in the output is dropped) and, with thinking on, an output without ``</think>`` was cut inside the
reasoning. ``enable_thinking: false`` makes the template end the prompt with an empty
``<think>\\n\\n</think>\\n\\n``: the output is then all content (vLLM's ``prompt_is_reasoning_end``;
vLLM's parser also reads ``chat_template_kwargs`` for it, here the prompt says it, so the text and
the engine's grammar agree). Not followed: vLLM's newest Qwen3.5 rule that a ``<tool_call>`` inside
the thinking ends it.
"""

from __future__ import annotations

from collections.abc import Sequence

from cb_serve.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Thinking is on unless the prompt closed the block (``enable_thinking: false``)."""
        return self.last_tag(prompt_token_ids) != self.think_end_id
