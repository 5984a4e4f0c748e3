"""``ReasoningSplitter``: one output's text split into reasoning and content as it streams.

The output starts in the reasoning or in the content (where the prompt left off: the parser
decides). In the reasoning, a start tag is dropped and the first end tag switches to the content
for good; everything after it, later tags included, is content (as vLLM's ``partition``). A tag
cut across two chunks is held back until the next chunk says what it is, so no part of a tag
is ever streamed; ``finish`` releases what is still held (an unfinished tag is plain text).
Streaming any split of a text gives the same two strings as ``split`` on the whole of it.
"""

from __future__ import annotations

from typing import Any

from cb_serve.text_stream import held_suffix


class ReasoningSplitter:
    """Splits one output's text; ``in_reasoning``: the output starts inside the reasoning."""

    def __init__(self, start_tag: str, end_tag: str, in_reasoning: bool) -> None:
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.started_in_reasoning = in_reasoning
        self.in_reasoning = in_reasoning
        self._held = ""  # the end of the text that may be the beginning of a tag (in the reasoning)

    @property
    def reasoning_ended(self) -> bool:
        """The text so far has left the reasoning (or never was in it)."""
        return not self.in_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        """The next chunk of text: its (reasoning, content) parts, either possibly empty."""
        if not self.in_reasoning:
            return "", delta
        text, self._held = self._held + delta, ""
        reasoning: list[str] = []
        while True:
            end, start = text.find(self.end_tag), text.find(self.start_tag)
            if end >= 0 and (start < 0 or end < start):
                reasoning.append(text[:end])
                self.in_reasoning = False
                return "".join(reasoning), text[end + len(self.end_tag) :]
            if start < 0:
                break
            reasoning.append(text[:start])  # a start tag inside the reasoning is dropped
            text = text[start + len(self.start_tag) :]
        held = held_suffix(text, (self.start_tag, self.end_tag))
        self._held = text[len(text) - held :]
        reasoning.append(text[: len(text) - held])
        return "".join(reasoning), ""

    def finish(self) -> tuple[str, str]:
        """At the end of the output: what was held back (an unfinished tag is reasoning text)."""
        held, self._held = self._held, ""
        return held, ""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """The whole of an output's text as (reasoning, content), None for an empty part (starting
        where this splitter started, whatever it was fed since)."""
        return split_whole(ReasoningSplitter(self.start_tag, self.end_tag, self.started_in_reasoning), text)


def split_whole(fresh: Any, text: str) -> tuple[str | None, str | None]:
    """A whole output's text as (reasoning, content) through a ``fresh`` splitter (any with ``feed`` and
    ``finish``), None for an empty part."""
    reasoning, content = fresh.feed(text)
    more_reasoning, more_content = fresh.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None
