"""OpenAI response bodies built from an engine replica's chunks: choices (whole, or as stream
deltas), logprobs, usage, and tool calls parsed out of the text when the request has tools."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cb_serve import ToolCallParser
from cb_serve.serve.choice_assembler import ChoiceAssembler, ReasoningSplitter
from cb_serve.serve.engine_chunk import EngineChunk


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
    tool_parser: Callable[[], ToolCallParser] | None = None  # makes each choice's parser (None: Hermes)

    def base(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choices(self, n: int, reasoning: Callable[[], ReasoningSplitter] | None = None) -> list[Choice]:
        """``reasoning``: makes each choice's reasoning splitter (None: no reasoning parser)."""
        make = self.tool_parser
        return [Choice(i, self.chat, self.tools, self.max_calls, reasoning and reasoning(), make) for i in range(n)]


class Usage:
    def __init__(self, n: int) -> None:
        self.prompt_tokens = 0
        self.completion = [0] * n
        self.cached = 0
        self.timeline: dict[str, Any] | None = None

    def add(self, chunk: EngineChunk) -> None:
        self.timeline = chunk.timeline or self.timeline
        self.prompt_tokens = chunk.prompt_tokens
        self.cached = chunk.cached_tokens
        self.completion[chunk.index] += chunk.num_tokens

    def body(self) -> dict[str, Any]:
        total = sum(self.completion)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": total,
            "total_tokens": self.prompt_tokens + total,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }


def completion_logprobs(entries: list[dict] | None) -> dict[str, Any] | None:
    """OpenAI's completion ``logprobs`` (an echoed prompt's first token has none: null)."""
    if not entries:
        return None
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [None if e["top"] is None else dict(e["top"]) for e in entries],
        "text_offset": [],
    }


def prompt_logprobs_body(raw: list[dict | None] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or ``{token_id: {logprob, rank,
    decoded_token}}`` with the top-k and the prompt's own token."""
    if raw is None:
        return None
    return [
        None if e is None else {str(t): {"logprob": lp, "rank": r, "decoded_token": d} for t, (lp, r, d) in e.items()}
        for e in raw
    ]


def echo_entries(raw: list[dict | None], prompt_token_ids: list[int], first_text: str) -> list[dict]:
    """The prompt's tokens as completion logprob entries (``echo``), best alternatives first."""
    out: list[dict] = [{"token": first_text, "logprob": None, "top": None}]
    for token_id, entry in zip(prompt_token_ids[1:], raw[1:]):
        top = [(d, lp) for lp, _, d in sorted(entry.values(), key=lambda v: -v[0])]
        out.append({"token": entry[token_id][2], "logprob": entry[token_id][0], "top": top})
    return out


@dataclass(frozen=True)
class EchoedPrompt:
    text: str
    token_ids: list[int]
    first_token: str  # the first token's text (it has no logprob)


async def echo_chunks(
    chunks: AsyncIterator[EngineChunk], prompts: list[EchoedPrompt], n: int, echo_only: bool
) -> AsyncIterator[EngineChunk]:
    """``echo``: each choice's first chunk starts with its prompt's text (and, with logprobs, its
    prompt's logprob entries); ``echo_only`` (``max_tokens: 0``) drops what was generated."""
    started: set[int] = set()
    raw: dict[int, list] = {}  # prompt -> its prompt logprobs (sent with one of its choices' chunks)
    async for c in chunks:
        p = c.index // n
        if c.prompt_logprobs is not None:
            raw[p] = c.prompt_logprobs
        if echo_only:
            c = c.replace(text="", num_tokens=0, logprobs=[] if c.logprobs is not None else None)
        if c.index not in started:
            started.add(c.index)
            logprobs = c.logprobs
            if logprobs is not None and p in raw:
                logprobs = echo_entries(raw[p], prompts[p].token_ids, prompts[p].first_token) + logprobs
            c = c.replace(text=prompts[p].text + c.text, logprobs=logprobs)
        yield c


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
    """One OpenAI choice (chat or completion) as its chunks arrive, over a ``ChoiceAssembler``:
    with tools, ``<tool_call>`` blocks become ``tool_calls``; with a reasoning parser, the thinking
    is ``reasoning`` (and ``reasoning_content``, the older name some clients read)."""

    def __init__(
        self,
        index: int,
        chat: bool,
        tools: bool = False,
        max_calls: int | None = None,
        reasoning: ReasoningSplitter | None = None,
        tool_parser: Callable[[], ToolCallParser] | None = None,
    ) -> None:
        """``max_calls``: the calls kept (1 for ``parallel_tool_calls: false``; later ones are dropped)."""
        self.index, self.chat = index, chat
        self.assembler = ChoiceAssembler(index, tools, max_calls, reasoning, tool_parser)
        self.held_back = tools or reasoning is not None  # a chunk may add nothing to send yet
        self.logprobs: list[dict] = []
        self.prompt_logprobs: list[dict | None] | None = None  # vLLM's extra, when asked for
        self._sent_role = False

    def delta(self, chunk: EngineChunk) -> dict[str, Any] | None:
        """The stream choice for one chunk; None when there is nothing to send yet (text held
        back while it may be a tool call or a think tag)."""
        d = self.assembler.feed(chunk)
        self.logprobs += chunk.logprobs or []
        choice: dict[str, Any] = {"index": self.index, "finish_reason": d.finish_reason}
        if chunk.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_body(chunk.prompt_logprobs)
        if not self.chat:
            return {**choice, "text": d.content, "logprobs": completion_logprobs(chunk.logprobs)}
        if self.held_back and not (
            d.content or d.reasoning or d.tool_calls or d.finish_reason or chunk.logprobs or not self._sent_role
        ):
            return None
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning"] = delta["reasoning_content"] = d.reasoning
        delta["content"] = d.content if d.content or not (d.tool_calls or d.reasoning) else None
        if d.tool_calls:
            first = self.assembler.num_calls - len(d.tool_calls)
            delta["tool_calls"] = [c.to_openai(first + i) for i, c in enumerate(d.tool_calls)]
        if not self._sent_role:
            self._sent_role = True
            delta["role"] = "assistant"
        return {**choice, "delta": delta, "logprobs": chat_logprobs(chunk.logprobs)}

    def add(self, chunk: EngineChunk) -> None:
        self.assembler.feed(chunk)
        self.logprobs += chunk.logprobs or []
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs_body(chunk.prompt_logprobs)

    @property
    def text(self) -> str:
        return self.assembler.content

    def body(self) -> dict[str, Any]:
        """The whole choice, once every chunk was added."""
        r = self.assembler.result()
        choice: dict[str, Any] = {"index": self.index, "finish_reason": r.finish_reason}
        if not self.chat:
            extra = {"prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else {}
            return {**choice, "text": r.content or "", "logprobs": completion_logprobs(self.logprobs), **extra}
        message: dict[str, Any] = {"role": "assistant", "content": r.content}
        if r.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = r.reasoning
        if r.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in r.tool_calls]
        return {**choice, "message": message, "logprobs": chat_logprobs(self.logprobs)}
