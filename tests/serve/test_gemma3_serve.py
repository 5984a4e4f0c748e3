"""``serve run deploy/config.gemma3.yaml`` as a user runs it, with the real Gemma 3 270M: the
``openai`` client's completions, plain and streamed, equal offline greedy decoding, and a chat
request to this base model is a 400 that says why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from serving import serve_run

from cb_serve.model_executor.builtin_models import GEMMA3_INSTALL, GEMMA3_PACKAGE

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(GEMMA3_PACKAGE) is None, reason=f"gemma-3-270m not installed (`{GEMMA3_INSTALL}`)"
)
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def offline():
    from cb_serve import LLM, SamplingParams

    llm = LLM("gemma-3-270m", max_model_len=256, num_gpu_blocks=6 * 64)  # 6 KV-cache groups of 3 layers
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def server(tmp_path_factory, offline):  # (offline first: the two engines never load at once)
    with serve_run(ROOT / "deploy" / "config.gemma3.yaml", tmp_path_factory.mktemp("gemma3"), {}) as base:
        yield base


def test_completions_and_streams_equal_offline(server, offline):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=120, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["gemma-3-270m"]
    for prompt, text in zip(PROMPTS, offline):
        resp = client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=12, temperature=0)
        assert resp.choices[0].text == text
        stream = client.completions.create(
            model="gemma-3-270m", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text


def test_a_chat_request_is_a_400_naming_completions(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=60, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="gemma-3-270m", messages=[{"role": "user", "content": "Hi"}])
