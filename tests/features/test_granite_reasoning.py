"""Granite 3.2 / 3.3 reasoning (issue 52): thinking written as text markers (vLLM's ``granite`` parser), split
into reasoning and content as it streams; an output that does not open with a marker is all content."""

from __future__ import annotations

import pytest

from cb_serve import EngineConfig, reasoning_parser
from cb_serve.reasoning import GraniteSplitter

CASES = [
    # Granite 3.3 (its template asks for <think></think> then <response></response>)
    ("<think>Cold front; check.</think><response>It will rain.</response>", "Cold front; check.", "It will rain."),
    # Granite 3.2
    ("Here is my thought process:\nCold front.\nHere is my response:\nIt will rain.", "Cold front.", "It will rain."),
    ("Here's my thought process: a\nHere's my response: b", "a", "b"),
    ("It will rain.", None, "It will rain."),  # thinking off
    ("<think>cut off mid-thought", "cut off mid-thought", None),  # max_tokens inside the reasoning
    ("Here is", None, "Here is"),  # a start that never completes is content
    ("Here is my thought process: x\nHere's my response: y", "x", "y"),  # 3.2 spells each marker either way
    ("<think>a</think><response>Is 2 <", "a", "Is 2 <"),  # an answer cut where a tag could start keeps its end
    ("<think>a</think><response>see </res", "a", "see </res"),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_whole_and_streamed_at_every_split(text, reasoning, content):
    assert GraniteSplitter().split(text) == (reasoning, content)
    for cut in range(1, len(text)):
        splitter = GraniteSplitter()
        r1, c1 = splitter.feed(text[:cut])
        r2, c2 = splitter.feed(text[cut:])
        r3, c3 = splitter.finish()
        assert ((r1 + r2 + r3) or None, (c1 + c2 + c3) or None) == (reasoning, content), cut


def test_the_engine_argument_names_it(tokenizer):
    assert EngineConfig(reasoning_parser="granite").reasoning_parser == "granite"
    parser = reasoning_parser("granite", tokenizer)  # no think tokens needed: the markers are text
    assert not parser.starts_in_reasoning([1, 2, 3]) and isinstance(parser.splitter([1]), GraniteSplitter)
