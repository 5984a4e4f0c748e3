"""The items of OpenAI's Responses API: the input items (pydantic) and the chat messages they become,
the output items and the stream events that build them, and the store of conversations behind
``previous_response_id``.

Input items and their parts take strict JSON types and ignore fields they do not use (a client sends
output items back whole: ``id``, ``status``, ``annotations``, ...); items, parts, tools and tool choices
of a type not served validate as ``Other``, so that the request's ``unsupported()`` names where they are.

The store: one ``ResponseStore`` per router replica, in memory. A response created with ``store`` (the
default) keeps its whole conversation (its input as chat messages, after the stored conversation it
continued, then its output as one assistant message), and a later request on the same replica
continues it by id. Bounds: at most ``max_entries`` responses and ``max_bytes`` bytes of their JSON
text together; past either, the least recently used go first (a conversation larger than
``max_bytes`` is not kept). Each entry holds its conversation whole, so a chain of k turns stores k
growing prefixes, all within the byte cap. Nothing survives a restart; another router replica does
not see them.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, model_validator

from cb_serve import ParsedToolCall
from cb_serve.serve.request_parts import JsonObjectText, media_parts_refused

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text")
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20


class Item(BaseModel):
    """An input item or part: strict JSON types, fields it does not use ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(Item):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(Item):
    type: Literal["refusal"]
    refusal: str


class ImagePart(Item):
    """``input_image``: a data URL (or an http(s) URL where the server allows its domain); no Files API."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _url(self) -> ImagePart:
        if self.file_id is not None:
            raise ValueError("input_image by file_id is not supported (no Files API): send image_url")
        if self.image_url is None:
            raise ValueError("input_image needs image_url")
        return self


class Other(Item):
    """An item, part, tool or tool choice of another type: refused by name in ``unsupported()``."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str


def tagger(known: tuple[str, ...], default: str | None = None) -> Callable[[Any], str | None]:
    """A discriminator: the value's ``type`` (``default`` when absent) if ``known``, else ``other``."""

    def tag(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        if not isinstance(kind, str):
            return None
        return ("text" if kind in TEXT_PARTS else kind) if kind in known else "other"

    return tag


Part = Annotated[
    Annotated[TextPart, Tag("text")]
    | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[ImagePart, Tag("input_image")]
    | Annotated[Other, Tag("other")],
    Discriminator(tagger((*TEXT_PARTS, "refusal", "input_image"))),
]


def text_of(content: str | list[Any]) -> str:
    """A content's text (its parts joined; a refusal counts as text)."""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content
                   if isinstance(p, (TextPart, RefusalPart)))  # fmt: skip


def content_of(content: str | list[Any]) -> str | list[dict[str, Any]]:
    """A message's content for the chat request: its text, or with images, chat content parts in order."""
    if isinstance(content, str) or not any(isinstance(p, ImagePart) for p in content):
        return text_of(content)
    return [{"type": "image_url", "image_url": {"url": p.image_url}} if isinstance(p, ImagePart)
            else {"type": "text", "text": text_of([p])} for p in content if not isinstance(p, Other)]  # fmt: skip


def parts_unsupported(content: str | list[Any]) -> str | None:
    """What a content holds that is not text (images, files, audio), or None."""
    return media_parts_refused([p.type for p in content if isinstance(p, Other)] if isinstance(content, list) else [])


class MessageItem(Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: JsonObjectText


class FunctionCallOutputItem(Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(Item):
    type: Literal["reasoning"]


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[Other, Tag("other")],
    Discriminator(tagger(ITEM_TYPES, default="message")),
]


def chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A ``tool_calls`` entry of a chat message."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(items: str | list[Any] | None) -> list[dict[str, Any]]:
    """Input items as chat messages: a ``function_call`` joins the assistant message before it (a
    new one if there is none), so consecutive calls make one message; reasoning items are dropped."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": content_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = chat_call(item.call_id, item.name, item.arguments)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
    return messages


def output_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the one assistant message a continuation's prompt shows (no reasoning)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [item for item in output if item["type"] == "function_call"]
    if not calls:
        return {"role": "assistant", "content": text}
    tool_calls = [chat_call(c["call_id"], c["name"], c["arguments"]) for c in calls]
    return {"role": "assistant", "content": text or None, "tool_calls": tool_calls}


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``resp_``, ``msg_``, ``rs_`` or ``fc_`` and 32 hex digits."""
    return f"{prefix}_{secrets.token_hex(16)}"


class Output:
    """The output items of one response as its deltas arrive, and the stream events that make them:
    text and reasoning go into the open item (a new one when the kind changes); calls come whole."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # the items done
        self.sequence_number = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written
        self._text = ""

    def event(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.items)}

    def _write(self, kind: str, text: str, force: bool = False) -> list[str]:
        if not text and not force:
            return []
        out = []
        if self._open is None or self._open["type"] != kind:
            out = self.close("completed")
            if kind == "reasoning":
                self._open = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                self._open = {"type": "message", "id": new_id("msg"), "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open["status"], self._text = "in_progress", ""
            out.append(self.event("response.output_item.added", output_index=len(self.items), item=self._open))
            out.append(self.event("response.content_part.added", **self._at(self._open), content_index=0, part=part))
        self._text += text
        if text:
            delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            logprobs = {} if kind == "reasoning" else {"logprobs": []}
            out.append(self.event(delta, **self._at(self._open), content_index=0, delta=text, **logprobs))
        return out

    def reasoning(self, text: str) -> list[str]:
        return self._write("reasoning", text)

    def content(self, text: str, force: bool = False) -> list[str]:
        """``force``: a message item even for no text."""
        return self._write("message", text, force)

    def calls(self, calls: list[ParsedToolCall]) -> list[str]:
        out = self.close("completed") if calls else []
        for call in calls:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}  # fmt: skip
            at = self._at(item)
            out.append(self.event("response.output_item.added", output_index=at["output_index"], item=item))
            out.append(self.event("response.function_call_arguments.delta", **at, delta=call.arguments))
            out.append(self.event("response.function_call_arguments.done", **at, arguments=call.arguments))
            item = {**item, "arguments": call.arguments, "status": "completed"}
            out.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
            self.items.append(item)
        return out

    def close(self, status: str) -> list[str]:
        """Ends the open item (if any) with ``status``."""
        if self._open is None:
            return []
        item, text, at = self._open, self._text, self._at(self._open)
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            out = [self.event("response.reasoning_text.done", **at, content_index=0, text=text)]
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = [self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])]
        out.append(self.event("response.content_part.done", **at, content_index=0, part=part))
        item = {**item, "content": [part], "status": status}
        out.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
        self.items.append(item)
        self._open = None
        return out

    def end(self, status: str) -> list[str]:
        """Closes the output: a message item (maybe empty) unless there is one or a call."""
        out = [] if any(i["type"] in ("message", "function_call") for i in self.items) else self.content("", True)
        return out + self.close("completed" if status == "completed" else "incomplete")


class ResponseStore:
    """Conversations (lists of chat messages) by response id; LRU within both caps; thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one entry and one byte")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, messages: list[dict[str, Any]]) -> bool:
        """Stores ``messages`` under ``key`` (evicting the least recently used past the caps); False
        when the conversation alone exceeds ``max_bytes`` (then it is not kept)."""
        data = json.dumps(messages, ensure_ascii=False, separators=(",", ":")).encode()
        with self._lock:
            self._drop(key)
            if len(data) > self.max_bytes:
                return False
            self._entries[key] = data
            self._bytes += len(data)
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._bytes -= len(self._entries.popitem(last=False)[1])
        return True

    def get(self, key: str) -> list[dict[str, Any]] | None:
        """A fresh copy of the conversation stored under ``key`` (now the most recently used), or None."""
        with self._lock:
            data = self._entries.get(key)
            if data is None:
                return None
            self._entries.move_to_end(key)
        return json.loads(data)

    def _drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def bytes(self) -> int:
        """The JSON text of all stored conversations, in bytes."""
        return self._bytes
