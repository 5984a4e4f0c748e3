"""``HarmonySplitter``: a gpt-oss output (OpenAI's Harmony format, ``harmony_format.py``) split as it streams:
the ``analysis`` channel is the reasoning; the ``final`` channel, and ``commentary`` without a recipient (a
preamble), the content. A tool-call message (``commentary`` to ``functions.NAME``) passes on in one normal
form, ``<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>``, which the ``openai`` tool-call
parser reads (``tool_parsers/harmony.py``). The HTTP layer uses it for every model whose chat template writes
Harmony (vLLM's ``openai_gptoss`` reasoning parser), so no reasoning reaches the content."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cb_serve.harmony_format import (
    CALL,
    CHANNEL,
    HARMONY_CALL_OPEN,
    MESSAGE,
    START,
    HarmonyPiece,
    HarmonyStream,
    is_harmony_template,
)
from cb_serve.reasoning.splitter import split_whole

FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"  # where the answer begins: the end of the reasoning


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


class HarmonyReasoningEnd:
    """Where gpt-oss's reasoning ends at the token level, for the engine's grammars: the header that opens the
    ``final`` channel, ``<|channel|>final<|message|>`` (vLLM's ``openai_gptoss`` ends it there too), so a
    ``response_format`` constrains the answer after the analysis. Built for every model whose chat template
    writes Harmony (``for_model``)."""

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        if any(marker not in vocab for marker in (START, CHANNEL, MESSAGE)):
            raise ValueError(f"a Harmony model's tokenizer has {START}, {CHANNEL} and {MESSAGE} as tokens")
        self.start_id: int = vocab[START]
        self.end_ids: tuple[int, ...] = tuple(tokenizer.encode(FINAL_HEADER, add_special_tokens=False))

    @classmethod
    def for_model(cls, tokenizer: Any, tool_call_parser: str | None) -> HarmonyReasoningEnd | None:
        """One for a model that writes Harmony (its template's markers, or ``--tool-call-parser openai``)."""
        template = getattr(tokenizer, "chat_template", None)
        templates = template.values() if isinstance(template, dict) else [template]
        harmony = tool_call_parser == "openai" or (
            tool_call_parser is None and any(is_harmony_template(t) for t in templates)
        )
        return cls(tokenizer) if harmony else None

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """The output starts in the analysis when the prompt ends in a message (after its last ``<|start|>``) that
        has not opened the final channel: not for a prompt that did (``continue_final_message``), nor for a
        prompt with no Harmony message at all (a raw completion), which are constrained from the first token."""
        ids = list(prompt_token_ids)
        if self.start_id not in ids:
            return False
        last = ids[len(ids) - 1 - ids[::-1].index(self.start_id) :]
        n = len(self.end_ids)
        return not any(tuple(last[i : i + n]) == self.end_ids for i in range(len(last) - n + 1))
