"""Clients that work unchanged: ``serve run deploy/config.yaml`` as a user runs it (plus a second
application in the same config: a tiny scripted model whose Qwen3-like template thinks in
``<think>``, served with ``reasoning_parser: qwen3`` at ``/thinker``), driven by the real client
libraries on 127.0.0.1:

- the ``openai`` client's Responses API, whole and streamed, with a function tool over two turns;
- the OpenAI Agents SDK (its default Responses model) running an agent with one function tool;
- the ``anthropic`` client's Messages API, whole and streamed, with tool use, and count_tokens;
- lm-evaluation-harness's ``local-completions`` on a log-likelihood task from a local YAML and data
  file, whose accuracy equals lm-eval's ``hf`` model on the same weights;
- vLLM's extras (penalties, logit_bias, bad_words, echo, prompt_logprobs, list prompts), the small
  endpoints, and reasoning split out of the text, streamed and whole.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from serving import API_KEY, AUTH, smol_server

ROOT = Path(__file__).resolve().parents[2]
BASE = "http://127.0.0.1:8000"
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    """deploy/config.yaml with speculation on, an API key and the thinker app (``serving.smol_server``)."""
    with smol_server(tmp_path_factory, tokenizer) as base:
        yield base


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=120, max_retries=0)


def weather_tool() -> dict:
    return {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}


def test_responses_create_with_a_function_tool_over_two_turns(client, model):
    question = "What is the weather in Paris? Use the tool."
    first = client.responses.create(
        model=model,
        input=question,
        tools=[weather_tool()],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=128,
    )
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny", "celsius": 21}'}
    second = client.responses.create(
        model=model,
        input=[{"role": "user", "content": question}, *[i.model_dump() for i in first.output], result],
        tools=[weather_tool()],
        tool_choice="none",
        max_output_tokens=24,
    )
    assert second.status in ("completed", "incomplete") and second.output_text
    assert not [item for item in second.output if item.type == "function_call"]


def test_responses_stream_with_previous_response_id(client, model):
    stream = client.responses.create(
        model=model, input="Weather in Oslo? Use the tool.", tools=[weather_tool()], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=128, stream=True,
    )  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == sorted(e.sequence_number for e in events)
    done = events[-1].response
    (call,) = [item for item in done.output if item.type == "function_call"]
    follow = client.responses.create(
        model=model,
        previous_response_id=done.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "cloudy, 12 C"}],
        tool_choice="none",
        max_output_tokens=16,
        stream=True,
    )
    texts = [e.delta for e in follow if e.type == "response.output_text.delta"]
    assert "".join(texts)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, previous_response_id="resp_unknown", input="hi", max_output_tokens=4)


def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(server, model):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=120, max_retries=0)
        agent = agents.Agent(
            name="weather",
            instructions="Answer with the get_weather tool.",
            tools=[get_weather],
            model=agents.OpenAIResponsesModel(model=model, openai_client=client),  # the SDK's default model kind
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=128),
            tool_use_behavior="stop_on_first_tool",
        )
        return await agents.Runner.run(agent, "What's the weather in Rome?", max_turns=3)

    result = asyncio.run(run())
    assert calls and result.final_output == f"sunny in {calls[0]}"


def test_anthropic_messages_with_tool_use(server, model):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server, api_key=API_KEY, timeout=120, max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}
    question = {"role": "user", "content": "What is the weather in Paris? Use the tool."}
    first = client.messages.create(
        model=model,
        max_tokens=128,
        messages=[question],
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and "city" in use.input
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}
    turns = [question, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    with client.messages.stream(
        model=model, max_tokens=16, system="Be brief.", messages=turns, tools=[tool], tool_choice={"type": "none"}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0
    counted = client.messages.count_tokens(model=model, messages=turns, tools=[tool], system="Be brief.")
    assert counted.input_tokens > 20
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}])  # fmt: skip


TASK = """
task: capitals_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"), ("Greece", "Athens"), ("Norway", "Oslo"),
    ("Poland", "Warsaw"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("China", "Beijing"), ("Cuba", "Havana"),
    ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
]  # fmt: skip


def test_lm_eval_local_completions_equals_hf(server, model, tmp_path, tokenizer, smol_hf):
    """A log-likelihood task from a local YAML and JSONL file: local-completions (echo, logprobs,
    max_tokens 1, token-id prompts) and lm-eval's own ``hf`` model on the same weights."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    rows = []
    for i, (country, capital) in enumerate(CAPITALS):
        wrong = [c for _, c in CAPITALS[i + 1 :] + CAPITALS[:i]][:3]
        choices = [f" {c}" for c in sorted([capital, *wrong])]
        question = f"What is the capital of {country}?"
        rows.append({"question": question, "choices": choices, "answer": choices.index(f" {capital}")})
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "capitals.yaml").write_text(TASK.format(data=data))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    tasks = TaskManager(include_path=str(tmp_path))

    def accuracy(lm) -> tuple[float, float, list[float]]:
        out = lm_eval.simple_evaluate(model=lm, tasks=["capitals_local"], task_manager=tasks, log_samples=True)
        metrics = out["results"]["capitals_local"]
        samples = sorted(out["samples"]["capitals_local"], key=lambda d: d["doc_id"])
        lls = [float(r[0]) for d in samples for r in d["filtered_resps"]]  # each choice's log-likelihood
        return metrics["acc,none"], metrics["acc_stderr,none"], lls

    served = lm_eval.api.registry.get_model("local-completions")(
        model=model, base_url=f"{server}/v1/completions", tokenizer=str(tmp_path / "tokenizer"),
        tokenizer_backend="huggingface", num_concurrent=2, max_retries=1, timeout=120, header=AUTH,
    )  # fmt: skip
    ours, stderr, served_lls = accuracy(served)
    theirs, _, hf_lls = accuracy(HFLM(pretrained=smol_hf, tokenizer=tokenizer, batch_size=4))
    gap = max(abs(a - b) for a, b in zip(served_lls, hf_lls))
    print(f"lm-eval capitals_local: local-completions acc {ours:.4f} ± {stderr:.4f}, hf acc {theirs:.4f}, "
          f"{len(hf_lls)} log-likelihoods differ by at most {gap:.2e}")  # fmt: skip
    assert abs(ours - theirs) <= stderr, (ours, theirs, stderr)
    assert len(served_lls) == len(hf_lls) == 4 * len(CAPITALS) and gap < 1e-3  # each choice's score, not just the pick
    assert ours > 0.5  # the task is easy for the model: a broken scorer would be near chance (0.25)


def post(server: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, headers=AUTH, timeout=120)


def test_echo_prompt_logprobs_and_list_prompts(server, model):
    prompts = ["Hello there, how are", "The capital of France is"]
    ids = [post(server, "/tokenize", model=model, prompt=p).json()["tokens"] for p in prompts]
    for prompt in (prompts, ids):  # a list of texts, a list of token-id lists
        r = post(server, "/v1/completions", model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == prompts
        for c, token_ids in zip(choices, ids):
            lp = c["logprobs"]
            assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
            assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(token_ids)
    r = post(server, "/v1/completions", model=model, prompt=prompts[1], max_tokens=2, prompt_logprobs=2,
             temperature=0)  # fmt: skip
    (choice,) = r.json()["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and all(1 <= len(e) <= 3 for e in entries[1:])
    echoed = post(server, "/v1/completions", model=model, prompt=prompts[1], max_tokens=0, echo=True, logprobs=0)
    own = echoed.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    from_field = [e[str(t)]["logprob"] for t, e in zip(ids[1][1:], entries[1:])]
    assert from_field == pytest.approx(own, abs=1e-5)


def test_penalties_bias_and_bad_words_over_http(server, model):
    def complete(**fields) -> dict:
        r = post(server, "/v1/completions", model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                 **fields)  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    plain = complete()["text"]
    forced = post(server, "/tokenize", model=model, prompt=" banana", add_special_tokens=False).json()["tokens"]
    assert complete(logit_bias={str(forced[0]): 100})["text"] == " banana" * 8
    assert complete(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)["text"]
    first_word = plain.split()[0]
    assert first_word not in complete(bad_words=[first_word])["text"].split()[:1]
    bad = post(server, "/v1/completions", model=model, prompt="x", logit_bias={"99999999": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_small_endpoints(server, model):
    tok = post(server, "/tokenize", model=model, prompt="Hello world", return_token_strs=True).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] > 0
    assert post(server, "/detokenize", model=model, tokens=tok["tokens"]).json()["prompt"].endswith("Hello world")
    chat = post(server, "/tokenize", model=model, messages=[{"role": "user", "content": "Hi"}]).json()
    assert chat["count"] > 3
    assert httpx.get(f"{server}/version").json()["version"]
    assert httpx.get(f"{server}/ping").status_code == 200
    card = httpx.get(f"{server}/v1/models/{model}", headers=AUTH).json()
    assert card["id"] == model and card["max_model_len"] == tok["max_model_len"]
    assert httpx.get(f"{server}/v1/models/nope", headers=AUTH).status_code == 404


def test_unknown_fields_and_unimplemented_vllm_extras(server, model):
    unknown = post(server, "/v1/completions", model=model, prompt="x", made_up_field=1)
    assert unknown.status_code == 400 and "made_up_field" in unknown.json()["error"]["message"]
    beam = post(server, "/v1/completions", model=model, prompt="x", use_beam_search=True)
    assert beam.status_code == 400 and beam.json()["error"]["param"] == "use_beam_search"
    assert beam.json()["error"]["type"] == "unsupported"
    fcfs = post(server, "/v1/completions", model=model, prompt="x", priority=3, max_tokens=1)
    assert fcfs.status_code == 400 and fcfs.json()["error"]["param"] == "priority"
    cut = post(server, "/v1/completions", model=model, prompt="one two three four five", truncate_prompt_tokens=2,
               max_tokens=1)  # fmt: skip
    assert cut.json()["usage"]["prompt_tokens"] == 2
    usage = post(server, "/v1/completions", model=model, prompt="Hi", max_tokens=3, stream=True,
                 stream_options={"include_usage": True, "continuous_usage_stats": True})  # fmt: skip
    events = [json.loads(x[6:]) for x in usage.text.splitlines() if x.startswith("data: {")]
    assert all("usage" in e for e in events) and events[-1]["usage"]["completion_tokens"] == 3


def test_reasoning_split_whole_and_streamed(server, client, model):
    thinker = openai.OpenAI(base_url=f"{server}/thinker/v1", api_key=API_KEY, timeout=60, max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    whole = thinker.chat.completions.create(model="thinker", messages=messages, max_tokens=40, temperature=0)
    message = whole.choices[0].message
    assert message.reasoning == "Let me think" and message.content == '{"answer":4}'
    stream = thinker.chat.completions.create(model="thinker", messages=messages, max_tokens=40, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Let me think"
    assert "".join(d.content or "" for d in deltas) == '{"answer":4}'
    off = thinker.chat.completions.create(model="thinker", messages=messages, max_tokens=40,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert getattr(off.choices[0].message, "reasoning", None) is None and off.choices[0].message.content
    low = thinker.chat.completions.create(model="thinker", messages=messages, max_tokens=40, reasoning_effort="none")
    assert low.choices[0].message.content == off.choices[0].message.content
    with pytest.raises(openai.BadRequestError):  # SmolLM2's template has no thinking switch
        client.chat.completions.create(model=model, messages=messages, reasoning_effort="high", max_tokens=1)
