"""``HarmonySplitter``: a gpt-oss output (OpenAI's Harmony format, ``harmony_format.py``) split as it streams:
the ``analysis`` channel is the reasoning; the ``final`` channel, and ``commentary`` without a recipient (a
preamble), the content. A tool-call message (``commentary`` to ``functions.NAME``) passes on in one normal
form, ``<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>``, which the ``openai`` tool-call
parser reads (``tool_parsers/harmony.py``). The HTTP layer uses it for every model whose chat template writes
Harmony (vLLM's ``openai_gptoss`` reasoning parser), so no reasoning reaches the content."""

from __future__ import annotations

from cb_serve.harmony_format import CALL, HARMONY_CALL_OPEN, MESSAGE, HarmonyPiece, HarmonyStream
from cb_serve.reasoning.splitter import split_whole


class HarmonySplitter:
    def __init__(self) -> None:
        self._stream = HarmonyStream()
        self._in_call = False  # the last piece was of a tool call that has not ended

    def feed(self, text: str) -> tuple[str, str]:
        """The next chunk of text: its (reasoning, content) parts, either possibly empty."""
        return self._split(self._stream.feed(text))

    def finish(self) -> tuple[str, str]:
        """At the end of the output: the message being read ends (a tool call's stop token is not in the text)."""
        return self._split(self._stream.finish())

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's text as (reasoning, content), None for an empty part."""
        return split_whole(HarmonySplitter(), text)

    def _split(self, pieces: list[HarmonyPiece]) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for piece in pieces:
            header = piece.header
            if header is not None and header.tool_name is not None:  # a call, on whatever channel (gpt-oss
                if not self._in_call:  # writes some on analysis)
                    content.append(f"{HARMONY_CALL_OPEN}{header.tool_name}{MESSAGE}")
                content.append(piece.text)
                self._in_call = not piece.done
                if piece.done:
                    content.append(CALL)
            elif header is not None and header.channel == "analysis":
                reasoning.append(piece.text)
            else:  # final, a preamble, or text that is no Harmony message
                content.append(piece.text)
        return "".join(reasoning), "".join(content)
