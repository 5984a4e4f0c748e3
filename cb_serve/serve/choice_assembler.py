"""One choice's engine chunks as the neutral outputs every HTTP API formats (``frontend_base``):
the reasoning split off first (with a reasoning parser), then ``<tool_call>`` blocks parsed out of
the content (with tools: whole calls, each in the delta where its block closes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cb_serve import ToolCallParser
from cb_serve.serve.engine_chunk import EngineChunk
from cb_serve.serve.frontend_base import ChoiceDelta, ChoiceResult


class ReasoningSplitter(Protocol):
    """Splits streamed text into (reasoning, content) pieces (``cb_serve.reasoning``)."""

    def feed(self, text: str) -> tuple[str, str]: ...
    def finish(self) -> tuple[str, str]: ...


class DroppedReasoning:
    """``include_reasoning: false``: the reasoning is split off and dropped."""

    def __init__(self, splitter: ReasoningSplitter) -> None:
        self.splitter = splitter

    def feed(self, text: str) -> tuple[str, str]:
        return "", self.splitter.feed(text)[1]

    def finish(self) -> tuple[str, str]:
        return "", self.splitter.finish()[1]


class ChoiceAssembler:
    """Feed an engine replica's chunks of one choice in order; ``feed`` returns what each added,
    ``result`` the whole choice. A choice that called a tool and stopped finishes with
    ``tool_calls``; ``max_calls`` keeps that many calls (1 for ``parallel_tool_calls: false``)."""

    def __init__(
        self,
        index: int,
        tools: bool,
        max_calls: int | None = None,
        reasoning: ReasoningSplitter | None = None,
        tool_parser: Callable[[], ToolCallParser] | None = None,
    ) -> None:
        """``tool_parser``: makes the parser of the model's tool-call format (None: Hermes)."""
        self.index, self.max_calls, self.splitter = index, max_calls, reasoning
        self.parser = (tool_parser or ToolCallParser)() if tools else None
        self.content, self.reasoning = "", ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_calls = 0

    def feed(self, chunk: EngineChunk) -> ChoiceDelta:
        text, reasoning = chunk.text, ""
        finished = chunk.finish_reason is not None
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text)
            if finished:
                more_reasoning, more_text = self.splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        calls = []
        if self.parser is not None:
            text, calls = self.parser.feed(text)
            if finished:  # a format read whole at the end (Llama 3's JSON) completes its calls here
                before = len(self.parser.calls)
                text += self.parser.finish()
                calls = calls + self.parser.calls[before:]
            if self.max_calls is not None:
                calls = calls[: max(0, self.max_calls - self.num_calls)]
        self.num_calls += len(calls)
        self.content += text
        self.reasoning += reasoning
        if finished:
            self.finish_reason = (
                "tool_calls" if chunk.finish_reason == "stop" and self.num_calls else chunk.finish_reason
            )
            self.stop_reason = chunk.stop_reason
        return ChoiceDelta(self.index, text, reasoning, calls, self.finish_reason if finished else None,
                           self.stop_reason if finished else None)  # fmt: skip

    def result(self) -> ChoiceResult:
        calls = self.parser.calls[: self.max_calls] if self.parser is not None else []
        content = self.content if self.content or not calls else None
        reasoning = self.reasoning if self.splitter is not None and self.reasoning else None
        return ChoiceResult(self.index, content, reasoning, list(calls), self.finish_reason, self.stop_reason)
