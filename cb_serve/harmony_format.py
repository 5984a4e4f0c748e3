"""OpenAI's Harmony format (gpt-oss), read as it streams: the output is messages, each a header and a body,
``<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`` then ``<|end|>``, or
``<|call|>`` / ``<|return|>`` (stop tokens: the output ends there, unseen). The prompt ends with
``<|start|>assistant``, so the first header has no ``<|start|>``. Channels: ``analysis`` (the reasoning),
``commentary`` (a tool call when it has a recipient ``functions.NAME``, else a preamble for the user) and
``final`` (the answer). The markers are special tokens: a request read this way keeps them in its text.

``HarmonyStream.feed`` returns the pieces of message bodies each text delta completes, with their headers; a
marker cut across deltas is held back. Text that never becomes a header (a model that does not write Harmony)
comes back from ``finish`` as a piece without a header."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cb_serve.text_stream import held_suffix

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
BODY_ENDS = (END, CALL, RETURN, START)
# How the Harmony splitter passes a tool call on to the ``openai`` tool-call parser (one normal form).
HARMONY_CALL_OPEN = f"{CHANNEL}commentary to=functions."
RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
CHANNEL_NAME = re.compile(r"<\|channel\|>(\w+)")


@dataclass(frozen=True)
class HarmonyHeader:
    channel: str  # analysis, commentary, final ("" when the header names none)
    recipient: str | None = None  # functions.NAME for a tool call

    @classmethod
    def parse(cls, text: str) -> HarmonyHeader:
        """A header's text: what lies between ``<|start|>`` (or the output's start) and ``<|message|>``."""
        channel, recipient = CHANNEL_NAME.search(text), RECIPIENT.search(text)
        return cls(
            channel.group(1) if channel else "",
            recipient.group(1) if recipient else None,
        )

    @property
    def tool_name(self) -> str | None:
        """The function a tool-call message calls (None: not a call)."""
        if self.recipient is None or not self.recipient.startswith("functions."):
            return None
        return self.recipient.removeprefix("functions.") or None


@dataclass
class HarmonyPiece:
    header: HarmonyHeader | None  # None: text that is no Harmony message
    text: str
    done: bool = False  # the message ended with this piece


class HarmonyStream:
    def __init__(self) -> None:
        self._buffer = ""  # a header being read, or the end of a body that may begin a marker
        self._header: HarmonyHeader | None = None  # the message whose body is being read
        self._messages = 0  # headers read so far

    def feed(self, text: str) -> list[HarmonyPiece]:
        self._buffer += text
        pieces: list[HarmonyPiece] = []
        while True:
            if self._header is None:  # reading a header: up to <|message|>
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    return pieces
                self._header = HarmonyHeader.parse(self._buffer[:at].removeprefix(START))
                self._messages += 1
                self._buffer = self._buffer[at + len(MESSAGE) :]
                continue
            ends = [(self._buffer.find(m), m) for m in BODY_ENDS if m in self._buffer]
            if not ends:
                keep = held_suffix(self._buffer, BODY_ENDS)
                body, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
                if body:
                    pieces.append(HarmonyPiece(self._header, body))
                return pieces
            at, marker = min(ends)
            pieces.append(HarmonyPiece(self._header, self._buffer[:at], done=True))
            self._header = None
            self._buffer = self._buffer[at + (0 if marker == START else len(marker)) :]

    def finish(self) -> list[HarmonyPiece]:
        """The output ended (a stop token, or a limit): the message being read ends; text that never became a
        header is returned as such."""
        rest, header, self._buffer, self._header = self._buffer, self._header, "", None
        if header is not None:
            return [HarmonyPiece(header, rest, done=True)]
        if self._messages:  # a header cut off (a limit) after whole messages: no text of its own
            return []
        return [HarmonyPiece(None, rest, done=True)] if rest.strip() else []


def is_harmony_template(template: str | None) -> bool:
    """Whether a chat template renders Harmony (gpt-oss's): it writes channels between these markers."""
    return bool(template) and CHANNEL in template and MESSAGE in template and "<|start|>" in template
