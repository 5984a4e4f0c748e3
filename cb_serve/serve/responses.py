"""OpenAI response bodies built from an engine replica's chunks: choices (whole, or as stream
deltas), logprobs, usage, and tool calls parsed out of the text when the request has tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cb_serve import ToolCallParser


@dataclass(frozen=True)
class ResponseMeta:
    """What every body of one response shares: the request id, creation time and model name, and
    how its choices are built (chat or completion, tool calls parsed, at most ``max_calls``)."""

    id: str
    created: int
    model: str
    chat: bool
    tools: bool
    max_calls: int | None

    def base(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choices(self, n: int) -> list[Choice]:
        return [Choice(i, self.chat, self.tools, self.max_calls) for i in range(n)]


class Usage:
    def __init__(self, n: int) -> None:
        self.prompt_tokens = 0
        self.completion = [0] * n
        self.cached = 0
        self.timeline: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        self.timeline = chunk.get("timeline") or self.timeline
        self.prompt_tokens = chunk["prompt_tokens"]
        self.cached = chunk["cached_tokens"]
        self.completion[chunk["index"]] += chunk["num_tokens"]

    def body(self) -> dict[str, Any]:
        total = sum(self.completion)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": total,
            "total_tokens": self.prompt_tokens + total,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


def completion_logprobs(entries: list[dict] | None) -> dict[str, Any] | None:
    if not entries:
        return None
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [dict(e["top"]) for e in entries],
        "text_offset": [],
    }


def chat_logprobs(entries: list[dict] | None) -> dict[str, Any] | None:
    if not entries:
        return None
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": list(e["token"].encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e["top"]],
            }
            for e in entries
        ]
    }


class Choice:
    """One choice of a response as its chunks arrive. With ``tools``, ``<tool_call>`` blocks in
    the text become ``tool_calls`` (whole calls: a stream sends each call in one delta once its
    block closes), and a choice that called a tool and stopped finishes with ``tool_calls``."""

    def __init__(self, index: int, chat: bool, tools: bool = False, max_calls: int | None = None) -> None:
        """``max_calls``: the calls kept (1 for ``parallel_tool_calls: false``; later ones are dropped)."""
        self.index, self.chat, self.max_calls = index, chat, max_calls
        self.parser = ToolCallParser() if tools else None
        self.text, self.logprobs, self.finish_reason = "", [], None
        self._sent_role = False

    def _feed(self, chunk: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        """(content, new tool_calls entries) of one chunk."""
        self.logprobs += chunk["logprobs"] or []
        self.finish_reason = chunk["finish_reason"] or self.finish_reason
        if self.parser is None:
            return chunk["text"], []
        first = len(self.parser.calls)
        text, calls = self.parser.feed(chunk["text"])
        calls = calls[: max(0, self.max_calls - first)] if self.max_calls is not None else calls
        if chunk["finish_reason"]:
            text += self.parser.finish()
        if self.parser.calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return text, [c.to_openai(first + i) for i, c in enumerate(calls)]

    def delta(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The stream choice for one chunk; None when there is nothing to send yet (text held
        back while it may be a tool call)."""
        text, calls = self._feed(chunk)
        choice: dict[str, Any] = {
            "index": self.index,
            "finish_reason": self.finish_reason if chunk["finish_reason"] else None,
        }
        if not self.chat:
            return {**choice, "text": text, "logprobs": completion_logprobs(chunk["logprobs"])}
        if self.parser is not None and not (
            text or calls or chunk["finish_reason"] or chunk["logprobs"] or not self._sent_role
        ):
            return None
        delta: dict[str, Any] = {"content": text if text or not calls else None}
        if calls:
            delta["tool_calls"] = calls
        if not self._sent_role:
            self._sent_role = True
            delta["role"] = "assistant"
        return {**choice, "delta": delta, "logprobs": chat_logprobs(chunk["logprobs"])}

    def add(self, chunk: dict[str, Any]) -> None:
        self.text += self._feed(chunk)[0]

    def body(self) -> dict[str, Any]:
        """The whole choice, once every chunk was added."""
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason}
        if not self.chat:
            return {**choice, "text": self.text, "logprobs": completion_logprobs(self.logprobs)}
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.parser is not None and self.parser.calls:
            message["content"] = self.text or None
            message["tool_calls"] = [c.to_openai() for c in self.parser.calls[: self.max_calls]]
        return {**choice, "message": message, "logprobs": chat_logprobs(self.logprobs)}
