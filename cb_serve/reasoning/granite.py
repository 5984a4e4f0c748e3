"""``granite``: IBM Granite 3.2 and 3.3 (vLLM's ``granite``), whose thinking is text, not tokens. With thinking on
(the template's ``thinking`` switch), Granite 3.2 writes ``Here is my thought process:`` ... ``Here is my
response:`` (or ``Here's``), and Granite 3.3 ``<think>...</think><response>...</response>``. An output that
opens with either start is reasoning up to its end marker, then content (3.3's ``<response>`` tags dropped);
any other output is all content (thinking was off). At the token level nothing marks the end, so a grammar
applies from the first token (``think_end_id`` is none)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cb_serve.reasoning.base import ReasoningParser
from cb_serve.reasoning.splitter import split_whole
from cb_serve.text_stream import held_suffix

# (what opens the reasoning, what ends it, tags dropped from the content); Granite 3.2 spells each marker
# either way (vLLM's parser takes both)
FORMS = (
    (
        ("Here is my thought process:", "Here's my thought process:"),
        ("Here is my response:", "Here's my response:"),
        (),
    ),
    (("<think>",), ("</think>",), ("<response>", "</response>")),
)
STARTS = tuple(start for starts, _, _ in FORMS for start in starts)


class GraniteSplitter:
    """Splits one output's text into (reasoning, content) as it streams (``ReasoningSplitter``'s interface)."""

    def __init__(self) -> None:
        self._form: tuple[str, str, tuple[str, ...]] | None = None
        self._state = "start"  # start (which form?), reasoning, content
        self._held = ""
        self._skip_space = False

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        if self._state == "start":
            start = text.lstrip()
            opened = next((m for m in STARTS if start.startswith(m)), None)
            if opened is None and any(m.startswith(start) for m in STARTS):
                self._held = text  # not yet known: a start may be coming
                return "", ""
            if opened is None:
                self._state = "content"
                return "", text
            self._form = next(f for f in FORMS if opened in f[0])
            self._state, self._skip_space = "reasoning", True
            text = start[len(opened) :]
        if self._skip_space:  # the spaces after a marker belong to neither part
            text = text.lstrip()
            self._skip_space = not text
        if self._state == "reasoning":
            ends = self._form[1]
            at, end = min(((text.find(e), e) for e in ends if e in text), default=(-1, ""))
            if at < 0:  # held: a marker's beginning, and the spaces that may precede the end marker
                keep = max(held_suffix(text, ends), len(text) - len(text.rstrip()))
                keep = len(text) - len(text[: len(text) - keep].rstrip())
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            self._state, self._skip_space = "content", True
            reasoning, rest = text[:at].rstrip(), text[at + len(end) :]
            return reasoning, self.feed(rest)[1] if rest else ""
        return "", self._content(text)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        for tag in self._form[2] if self._form is not None else ():  # a cut tag at the end is text
            held = held.replace(tag, "")
        return "", held

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's text as (reasoning, content), None for an empty part."""
        return split_whole(GraniteSplitter(), text)

    def _content(self, text: str) -> str:
        if self._form is None:
            return text
        dropped = self._form[2]
        keep = held_suffix(text, dropped) if dropped else 0
        self._held, text = text[len(text) - keep :], text[: len(text) - keep]
        for tag in dropped:
            text = text.replace(tag, "")
        return text


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    tags_are_tokens = False

    def __init__(self, tokenizer: Any) -> None:  # no think tokens to look up: the markers are text
        self.think_start_id = self.think_end_id = -1

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        return False  # at the token level: the output's text decides (GraniteSplitter)

    def splitter(self, prompt_token_ids: Sequence[int]) -> GraniteSplitter:  # type: ignore[override]
        return GraniteSplitter()
