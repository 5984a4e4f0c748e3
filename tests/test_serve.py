"""Serving smoke test: ``serve run deploy/config.yaml`` as a user runs it, then the real
``openai`` client on 127.0.0.1 (bounded in time). The full serving acceptance suite
(concurrency, routing across replicas, disconnects, overload) belongs to the serving issue."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = "http://127.0.0.1:8000"
API_KEY = "test-key-123"  # the server runs with CB_SERVE_API_KEY set: every /v1 call needs it
AUTH = {"authorization": f"Bearer {API_KEY}"}
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "CB_SERVE_API_KEY": API_KEY}
    log_path = tmp_path_factory.mktemp("serve") / "serve_run.log"
    log = log_path.open("w")
    proc = subprocess.Popen([serve_bin, "run", "deploy/config.yaml"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def log_tail() -> str:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])

    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"serve run exited; its log ends:\n{log_tail()}"
            try:
                if httpx.get(f"{BASE}/v1/models", headers=AUTH, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail(f"the server did not come up within 240 s; its log ends:\n{log_tail()}")
        yield BASE
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True, timeout=60)
        log.close()


def test_openai_client_matches_offline(server, smol_llm):
    from cb_serve import SamplingParams

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    prompts = ["The capital of France is", "def add(a, b):"]
    offline = smol_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, off in zip(prompts, offline):
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert resp.choices[0].text == off.outputs[0].text
        assert resp.usage.completion_tokens == len(off.outputs[0].token_ids)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    offline_chat = smol_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=16),
                                 use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert text == offline_chat.text
    assert chunks[-1].usage.completion_tokens == len(offline_chat.token_ids)


HUGE = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
LONG_PROMPT = b'{"prompt": "' + b"hello " * 9000 + b'", "max_tokens": 1}'


@pytest.mark.parametrize(
    "path, body, status, headers",
    [
        ("/v1/completions", b"{not json", 400, AUTH),
        ("/v1/completions", b"[1, 2]", 400, AUTH),
        ("/v1/completions", b'{"prompt": 123}', 400, AUTH),
        ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 400, AUTH),
        ("/v1/completions", b'{"prompt": "x", "top_p": 2}', 400, AUTH),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400, AUTH),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, AUTH),
        ("/v1/completions", b'{"prompt": ""}', 400, AUTH),
        ("/v1/completions", b'{"prompt": "x", "n": 0}', 400, AUTH),
        ("/v1/completions", b'{"prompt": "x", "stop": 5}', 400, AUTH),
        ("/v1/completions", LONG_PROMPT, 400, AUTH),
        ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}', 404, AUTH),
        ("/v1/chat/completions", b'{"messages": []}', 400, AUTH),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, AUTH),
        ("/v1/chat/completions", b'{"messages": "hello"}', 400, AUTH),
        ("/v1/completions", HUGE, 413, AUTH),
        ("/v1/completions", b'{"prompt": "x"}', 401, {}),
        ("/v1/completions", b'{"prompt": "x"}', 401, {"authorization": "Bearer wrong"}),
        ("/v1/nothing", b"{}", 404, AUTH),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, headers):
    r = httpx.post(server + path, content=body, headers={"content-type": "application/json", **headers}, timeout=60)
    assert r.status_code == status, r.text[:500]
    assert set(r.json()["error"]) >= {"message", "type", "code"}
    assert "Traceback" not in r.text
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert ok.status_code == 200, "a normal request must still succeed afterwards"


def stats(server) -> dict:
    return httpx.get(f"{server}/stats", headers=AUTH, timeout=30).json()


def test_concurrent_streams_are_batched(server):
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=300, max_retries=0)
    lengths = [8 + (i % 5) for i in range(32)]

    async def one(i: int, n: int) -> int:
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=f"Request {i}: count to ten.",
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main() -> list[int]:
        return await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))

    assert asyncio.run(main()) == lengths
    assert stats(server)["max_batch_seqs"] > 1


def test_client_disconnect_aborts_and_frees_blocks(server):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # leave mid-stream: closing the connection must abort the engine request
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = stats(server)
        if s["num_running"] == 0 and s["kv_blocks_used"] == 0:
            break
        time.sleep(0.5)
    assert s["num_running"] == 0 and s["kv_blocks_used"] == 0, s
