"""Multi-LoRA through Ray Serve on 127.0.0.1 with two engine replicas and the real ``openai``
client: adapters named by the ``model`` field (from the config and loaded at run time behind
the API key), ``/v1/models`` with ``parent``, requests for an adapter routed to the replica
holding it, greedy text equal to the offline engine's, and typed errors (404 for unknown
names, 400 for bad adapters). Every wait is bounded."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from models import make_adapter
from serving import REPLICA_HEADER, SHARED_PORT, local_ray_serve, run_app

serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

PORT = SHARED_PORT  # one Ray cluster for these modules (serving.SHARED_CLUSTER_MODULES)
BASE = f"http://127.0.0.1:{PORT}"
KEY = "lora-test-key"
PROMPT = [1, 5, 9, 200, 33, 7] * 4
ENGINE = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "max_model_len": 512, "num_gpu_blocks": 128}


@pytest.fixture(scope="module")
def lora_app(tmp_path_factory, random_model_dir):
    model_dir = random_model_dir("llama")
    root = tmp_path_factory.mktemp("serve-adapters")
    paths = {
        name: make_adapter(model_dir, root / name, rank, seed) for name, rank, seed in [("a1", 8, 1), ("a2", 16, 2)]
    }
    with local_ray_serve(PORT):
        args = {
            "model": str(model_dir),
            "engine": {**ENGINE, "num_threads": 1},
            "lora_modules": {"a1": str(paths["a1"])},
            "router": {"api_key": KEY},
            "routing_stats_period_s": 0.2,
            "engine_replica": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
        }
        run_app(args, "lora")
        yield model_dir, paths


def client() -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key=KEY, timeout=60, max_retries=0)


async def complete(c: openai.AsyncOpenAI, model: str, max_tokens: int = 12) -> tuple[str, str]:
    raw = await c.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]


def post(path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{BASE}{path}", json=body, headers=headers, timeout=60)


def offline_texts(model_dir, paths) -> dict[str, str]:
    from cb_serve import LLM, LoRARequest, SamplingParams

    llm = LLM(str(model_dir), **ENGINE)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    texts = {"tiny": llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text}
    for i, (name, path) in enumerate(paths.items()):
        out = llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest(name, i + 1, str(path)))
        texts[name] = out[0].outputs[0].text
    return texts


@pytest.mark.timeout(600)
def test_adapters_by_model_name_routing_and_runtime_loading(lora_app):
    model_dir, paths = lora_app
    expected = offline_texts(model_dir, paths)
    assert len(set(expected.values())) == 3

    models = httpx.get(f"{BASE}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("tiny", None), ("a1", "tiny")]

    # Loading at run time: behind the API key, checked by an engine replica, names unique.
    a2 = {"lora_name": "a2", "lora_path": str(paths["a2"])}
    assert post("/v1/load_lora_adapter", a2, key=None).status_code == 401
    bad = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(model_dir / "nope")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_request", bad.text
    not_adapter = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(model_dir)})
    assert not_adapter.status_code == 400 and "adapter_config.json" in not_adapter.json()["error"]["message"]
    ok = post("/v1/load_lora_adapter", a2)
    assert ok.status_code == 200, ok.text
    taken = post("/v1/load_lora_adapter", a2)
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    assert post("/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": 7}).status_code == 400

    async def scenario() -> dict:
        c = client()
        with pytest.raises(openai.NotFoundError) as missing:
            await complete(c, "nope")
        assert missing.value.body["param"] == "model"
        await asyncio.sleep(1.0)  # the replicas' next reports say which one holds a2
        # One replica read a2 when it was loaded: its requests stay there while both are idle.
        a2 = [await complete(c, "a2") for _ in range(8)]
        a1 = [await complete(c, "a1") for _ in range(2)]
        base = [await complete(c, "tiny") for _ in range(2)]
        return {"a2": a2, "a1": a1, "base": base}

    r = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
    for name in ("a2", "a1", "base"):
        assert {text for text, _ in r[name]} == {expected["tiny" if name == "base" else name]}, (name, r[name])
    a2_replicas = Counter(replica for _, replica in r["a2"])
    assert len(a2_replicas) == 1, f"a2's requests must stay on the replica holding it: {a2_replicas}"

    assert post("/v1/unload_lora_adapter", {"lora_name": "nope"}).status_code == 404
    assert post("/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    assert post("/v1/load_lora_adapter", a2).status_code == 200  # loaded again: a new id, the same text
    assert asyncio.run(complete(client(), "a2"))[0] == expected["a2"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "a2"}).status_code == 200
    gone = httpx.post(
        f"{BASE}/v1/completions",
        json={"model": "a2", "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    stats = httpx.get(f"{BASE}/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert stats["max_loras"] == 2 and stats["lora_adapters_loaded"] >= 1
