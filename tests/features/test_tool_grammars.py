"""Forced tool calls in each family's own format (issue 52): the grammar of a ``tool_choice`` required or named
(``ToolCallParser.constraint``) writes the format the model's parser reads, its markers as the special tokens
the model's tokenizer has.

Two checks per format, on the built-in tokenizer with that family's markers added as special tokens:
- random walks through the grammar (tokens drawn at random from each step's mask, as a random model would,
  ending where the grammar may end) decode to text that the family's parser reads as calls of the given tools,
  whose arguments fit the schema, and nothing else;
- the turn the family's real chat template writes for a call is a path through the grammar."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch
from tool_defs import WEATHER

from cb_serve import TOOL_CALL_PARSERS, HarmonySplitter
from cb_serve.structured_outputs.base import allocate_bitmask
from cb_serve.structured_outputs.llguidance_backend import LLGuidanceBackend

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
DAYS = {
    "type": "function",
    "function": {
        "name": "forecast",
        "description": "The forecast.",
        "parameters": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}, "hourly": {"type": "boolean"}},
            "required": ["days", "hourly"],
        },
    },
}
TOOLS = [WEATHER, DAYS]
DEEPSEEK_TOKENS = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
]
# format, template fixture (its variant), the special tokens of the family's tokenizer, how a forced reply starts
CASES = [
    ("hermes", None, [], "<tool_call>\n{"),
    ("qwen3_coder", "qwen3_coder", [], "<tool_call>\n<function="),
    ("llama3_json", "llama3_json", [], '{"name": '),
    ("mistral", "ministral3", ["[TOOL_CALLS]", "[ARGS]"], "[TOOL_CALLS]"),
    ("mistral", "mistral3_json", ["[TOOL_CALLS]", "[ARGS]"], '[TOOL_CALLS] [{"name": '),
    ("granite", "granite3", ["<|tool_call|>"], '<|tool_call|>[{"name": '),
    ("deepseek_v3", "deepseek_v31", DEEPSEEK_TOKENS, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"),
    ("deepseek_v3", "deepseek_v3", DEEPSEEK_TOKENS, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"),
    ("openai", "gpt_oss", ["<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>"],
     "<|channel|>commentary to=functions."),
]  # fmt: skip


@pytest.fixture(scope="module")
def family_tokenizers(tokenizer):
    made = {}

    def make(specials: list[str]):
        key = tuple(specials)
        if key not in made:
            tok = copy.deepcopy(tokenizer)
            if specials:
                tok.add_special_tokens({"additional_special_tokens": specials})
            made[key] = tok
        return made[key]

    return make


def walk(backend: LLGuidanceBackend, grammar, rng: random.Random, eos: int, max_tokens: int = 400) -> list[int]:
    """Tokens drawn at random from each step's mask until the grammar ends (EOS, taken whenever allowed with
    probability 0.8) or is done."""
    matcher, ids = grammar.matcher(), []
    bitmask = allocate_bitmask(1, backend.vocab_size)
    bits = torch.arange(32, dtype=torch.int32)
    for _ in range(max_tokens):
        if matcher.is_terminated:
            return ids
        matcher.fill_bitmask(bitmask, 0)
        allowed = ((bitmask[0][:, None] >> bits) & 1).flatten()[: backend.vocab_size].nonzero().flatten().tolist()
        assert allowed, "the grammar allows nothing"
        if eos in allowed and rng.random() < 0.8:
            return ids
        token = rng.choice([t for t in allowed if t != eos] or allowed)
        assert matcher.accept_token(token)
        ids.append(token)
    raise AssertionError("no end within max_tokens")


def read_calls(fmt: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    """The content and calls the family's parser reads in ``text`` (gpt-oss: through the Harmony splitter)."""
    parser = TOOL_CALL_PARSERS[fmt](TOOLS)
    if fmt == "openai":
        splitter = HarmonySplitter()
        text = splitter.feed(text)[1] + splitter.finish()[1]
    content = parser.feed(text)[0] + parser.finish()
    return content, [(c.name, json.loads(c.arguments)) for c in parser.calls]


@pytest.mark.parametrize(("fmt", "template", "specials", "start"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
@pytest.mark.parametrize("parallel", [False, True])
def test_random_walks_through_the_grammar_are_calls_the_parser_reads(family_tokenizers, fmt, template, specials,
                                                                      start, parallel):  # fmt: skip
    tok = family_tokenizers(specials)
    text_of_template = (TEMPLATES / f"{template}.jinja").read_text() if template else ""
    constraint = TOOL_CALL_PARSERS[fmt].constraint(TOOLS, parallel, text_of_template)
    backend = LLGuidanceBackend(tok, len(tok))
    grammar = backend.compile(constraint)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng, counts = random.Random(f"{fmt}{template}{parallel}"), set()
    for _ in range(8):
        ids = walk(backend, grammar, rng, tok.eos_token_id)
        text = tok.decode(ids, skip_special_tokens=False)
        assert text.startswith(start), text
        for marker in specials:  # each marker is its special token, never spelled out of ordinary ones
            assert text.count(marker) == sum(tok.convert_ids_to_tokens(i) == marker for i in ids), (marker, text)
        content, calls = read_calls(fmt, text)
        assert content == "" and calls, text
        for name, arguments in calls:
            jsonschema.validate(arguments, schemas[name])
        counts.add(len(calls))
    assert counts == {1} if not parallel or fmt == "openai" else max(counts) > 1, counts


RENDERED = [c for c in CASES if c[1] not in (None, "granite3")]  # Granite 3.3's template renders no calls


@pytest.mark.parametrize(("fmt", "template", "specials", "start"), RENDERED, ids=[f"{c[0]}-{c[1]}" for c in RENDERED])
def test_the_real_templates_call_turn_is_a_path_through_the_grammar(family_tokenizers, fmt, template, specials, start):
    tok = family_tokenizers(specials)
    text_of_template = (TEMPLATES / f"{template}.jinja").read_text()
    arguments = {"city": "Rome", "unit": "C"}
    call = {"id": "a0bcdefgh", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    if template == "deepseek_v31":  # its template takes the arguments as JSON text
        call["function"]["arguments"] = json.dumps(arguments)
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    rendered = tok.apply_chat_template(messages, tools=TOOLS, chat_template=text_of_template, tokenize=False)
    if fmt == "openai":  # history puts the recipient in the role (``assistant to=functions.NAME<|channel|>``),
        # where a model writes it after the channel, as the grammar does: both are read
        reply = rendered.rsplit("<|start|>assistant", 1)[1].removesuffix("<|call|>")
        assert read_calls(fmt, reply) == ("", [("get_weather", arguments)])
        return
    at = rendered.rfind(start)  # the assistant's turn (a system prompt may show an example)
    assert at >= 0, rendered
    reply = rendered[at:]
    for end in ("<|im_end|>", "<|eot_id|>", "<｜tool▁calls▁end｜>", "<|call|>", "\n</tool_call>"):
        if end in reply:  # the turn ends there (an end-of-turn token, or the grammar's last marker, kept)
            keep = end if end in ("<｜tool▁calls▁end｜>", "\n</tool_call>") else ""
            reply = reply[: reply.index(end)] + keep
    if template == "deepseek_v3":  # vLLM's copy indents its turns: a model writes none of that
        reply = reply.replace("```<｜tool▁call▁end｜>", "```<｜tool▁call▁end｜>").split("<｜tool▁call▁end｜>")[0]
        reply += "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    if template == "mistral3_json":  # the template adds the call's id, which a model does not write
        reply = reply.replace(', "id": "bcdefgh"', "").replace(', "id": "a0bcdefgh"', "")
    ids = tok.encode(reply, add_special_tokens=False)
    backend = LLGuidanceBackend(tok, len(tok))
    matcher = backend.compile(TOOL_CALL_PARSERS[fmt].constraint([WEATHER], False, text_of_template)).matcher()
    assert matcher.valid_prefix(ids) == len(ids), (reply, tok.convert_ids_to_tokens(ids))
    assert read_calls(fmt, reply)[1] == [("get_weather", arguments)]
