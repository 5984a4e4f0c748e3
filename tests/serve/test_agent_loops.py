"""Agents on every family's own tool format (issue 52), tried as a new user would: a real Serve app per family
(random weights, the family's real chat template, its markers as special tokens of the tokenizer), driven by
the ``openai`` client, the OpenAI Agents SDK and the ``anthropic`` client. The calls are forced by
``tool_choice``, so the grammar writes each family's format and its parser reads it back:

- ``openai``: two turns, two tools: the first call named, then the second with the first's result in the
  history; both come back as ``tool_calls`` with schema-valid arguments;
- the Agents SDK: an agent with both tools, ``tool_choice="required"`` and one call a turn (a random model may
  not end a list of calls in time) runs one tool, sends its result in the next turn (the SDK resets the choice
  to auto) and ends with that turn's text;
- ``anthropic``: a forced ``tool_use``, then its ``tool_result`` accepted in the next turn;
- gpt-oss: a Harmony turn (written by a grammar) comes back as ``reasoning_content`` and ``content``, whole and
  streamed.

Families: Llama 3 (``llama3_json``), Mistral (Ministral 3's ``[TOOL_CALLS]NAME[ARGS]``), Qwen3.5's format on a
Qwen3.5 hybrid model (Qwen3-Coder's template: the XML calls Qwen3.5 writes) and gpt-oss (Harmony); by default
gpt-oss alone (``DEPLOYED``). One Ray cluster for the module; the
families' apps deploy in turn."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from models import make_random_model
from serving import SHARED_PORT, local_ray_serve, run_app
from tool_defs import CLOCK, WEATHER

from cb_serve.tool_format import closed

serve = pytest.importorskip("ray.serve")

PORT = SHARED_PORT  # one Ray cluster for these modules (serving.SHARED_CLUSTER_MODULES)
BASE = f"http://127.0.0.1:{PORT}"
TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
FAMILIES = {  # name: (architecture, template fixture, the special tokens its tokenizer has)
    "llama3": ("llama", "llama3_json", []),
    "mistral": ("mistral", "ministral3", ["[TOOL_CALLS]", "[ARGS]"]),
    "qwen3_5": ("qwen3_5_text", "qwen3_coder", []),
    "gpt_oss": ("gpt_oss", "gpt_oss", HARMONY_TOKENS),
}
ENGINE = {"max_model_len": 1024, "num_gpu_blocks": 128, "max_num_seqs": 4, "num_threads": 1}
TOOLS = [WEATHER, CLOCK]


@pytest.fixture(scope="module")
def cluster():
    with local_ray_serve(PORT):
        yield


# Every family is a deployment (about 11 s): CI deploys gpt-oss, whose format is both special tokens and
# channels; CB_SERVE_AGENT_FAMILIES=all deploys the four (the grammars and parsers of each are checked without a
# server in tests/features/test_tool_grammars.py, Mistral's special tokens through detokenization in
# tests/features/test_tool_calls.py).
DEPLOYED = list(FAMILIES) if os.environ.get("CB_SERVE_AGENT_FAMILIES") == "all" else ["gpt_oss"]


@pytest.fixture(scope="module", params=DEPLOYED)
def family(request, cluster, tmp_path_factory, tokenizer):
    """The family's app, deployed (replacing the previous family's)."""
    arch, template, specials = FAMILIES[request.param]
    tok = copy.deepcopy(tokenizer)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    model_dir = make_random_model(tmp_path_factory.mktemp(request.param), arch, tok, max_position_embeddings=1024)
    run_app({"model": str(model_dir), "engine": ENGINE}, f"agents-{request.param}")
    return request.param


def valid(name: str, arguments: dict) -> bool:
    """The arguments fit the tool's schema, closed (no key it does not name)."""
    (tool,) = [t for t in TOOLS if t["function"]["name"] == name]
    return jsonschema.Draft202012Validator(closed(tool["function"]["parameters"])).is_valid(arguments)


def test_openai_client_two_turns_two_tools(family):
    from openai import OpenAI

    client = OpenAI(base_url=f"{BASE}/v1", api_key="none", timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", (family, choice)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and valid("get_weather", json.loads(call.function.arguments))
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18})},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    (call,) = second.choices[0].message.tool_calls
    assert call.function.name == "get_time" and valid("get_time", json.loads(call.function.arguments))


def test_agents_sdk_runs_a_tool_and_takes_its_result(family):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        ran.append(("get_weather", city))
        return f"Sunny in {city}."

    @function_tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        ran.append(("get_time", tz))
        return f"12:00 {tz}"

    model = OpenAIChatCompletionsModel("tiny", AsyncOpenAI(base_url=f"{BASE}/v1", api_key="none", timeout=120))
    agent = Agent(
        name="helper", instructions="Use the tools.", model=model, tools=[get_weather, get_time],
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=64),
    )  # fmt: skip
    result = Runner.run_sync(agent, "Weather in Rome, and the time in UTC?", max_turns=4)
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert calls and len(outputs) == len(calls) == len(ran), (family, result.new_items)
    assert {name for name, _ in ran} <= {"get_weather", "get_time"}
    assert isinstance(result.final_output, str)  # the turn after the tool's result answered


def test_anthropic_client_forced_tool_use_and_its_result(family):
    import anthropic

    client = anthropic.Anthropic(base_url=BASE, api_key="none", timeout=120)
    tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in TOOLS
    ]  # fmt: skip
    messages = [{"role": "user", "content": "Time in CET?"}]
    first = client.messages.create(
        model="tiny", max_tokens=64, messages=messages, tools=tools, tool_choice={"type": "tool", "name": "get_time"}
    )
    assert first.stop_reason == "tool_use", (family, first)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_time" and valid("get_time", use.input)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]},
    ]
    second = client.messages.create(model="tiny", max_tokens=8, messages=messages, tools=tools)
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")


# A grammar makes the random gpt-oss write a whole Harmony turn, reasoning then answer: enabled in the reasoning
# (a constraint otherwise waits for the final channel, which a random model would never open)
HARMONY_REPLY = (
    'start: <|channel|> "analysis" <|message|> "Thinking it over." <|end|> '
    '<|start|> "assistant" <|channel|> "final" <|message|> "The answer."'
)


def test_gpt_oss_reasoning_and_content_come_back_apart_streamed_and_not(family):
    """The analysis channel is ``reasoning_content``, the final channel ``content``, whole and streamed."""
    if family != "gpt_oss":
        pytest.skip("Harmony: gpt-oss only")
    from openai import OpenAI

    client = OpenAI(base_url=f"{BASE}/v1", api_key="none", timeout=120)
    body = dict(model="tiny", messages=[{"role": "user", "content": "Why?"}], max_tokens=64,
                extra_body={"structured_outputs": {"grammar": HARMONY_REPLY, "enable_in_reasoning": True}})  # fmt: skip
    message = client.chat.completions.create(**body).choices[0].message
    assert message.content == "The answer." and message.model_extra["reasoning_content"] == "Thinking it over."
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == ("Thinking it over.", "The answer.")
