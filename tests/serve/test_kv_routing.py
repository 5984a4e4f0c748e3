"""KV-cache-aware routing with real Ray Serve, two engine replicas of a tiny random-weight
Llama, and real HTTP (issue 14, acceptance 2 and 3).

What the request router believes is read by asking it: a *probe* goes through a
``DeploymentHandle`` made in this process (whose request router gets the same replica reports
as the HTTP router's) with a conversation's block hashes but a one-token prompt, so probing
changes no replica's cache; the router writes its expected hit tokens per replica into the
request (``EngineRequest.expected_hit_tokens``). Every wait is bounded; no test asserts a timing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
from models import make_random_model
from serving import REPLICA_HEADER, SHARED_PORT, engine_replica_pids, local_ray_serve, run_app, wait_for

serve = pytest.importorskip("ray.serve")

PORT = SHARED_PORT  # one Ray cluster for these modules (serving.SHARED_CLUSTER_MODULES)
BASE = f"http://127.0.0.1:{PORT}"
APP = "kv-routing"
ROUTING_STATS_PERIOD_S = 0.5
ENGINE = {
    "max_model_len": 1024,
    "num_gpu_blocks": 96,  # 1536 tokens: a few long prompts evict a conversation
    "block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "num_threads": 1,
}
SYSTEM = " ".join(f"Rule {i}: answer in plain words and keep every reply short." for i in range(20))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return make_random_model(tmp_path_factory.mktemp("llama-routing"), "llama", tokenizer, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def app(model_dir):
    with local_ray_serve(PORT):
        run_app(
            {
                "model": str(model_dir),
                "engine": ENGINE,
                "routing_stats_period_s": ROUTING_STATS_PERIOD_S,
                "engine_replica": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
            },
            APP,
        )
        yield


@pytest.fixture(scope="module")
def encoder(model_dir):
    from cb_serve import EngineConfig, PromptEncoder

    return PromptEncoder(EngineConfig.from_kwargs(model=str(model_dir)))


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model in one offline engine: the greedy text every replica must give."""
    from cb_serve import LLM, SamplingParams

    llm = LLM(str(model_dir), **{k: v for k, v in ENGINE.items() if k != "num_threads"})
    return lambda messages, n: (
        llm.chat([messages], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0].text
    )


def conversation(topic: str, turns: int = 1, system: str = SYSTEM) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Tell me about {topic}, part {t}: " + "details " * 20})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"Here is part {t} about {topic}. " * 4})
    return messages


def chat(messages: list[dict], max_tokens: int = 4, session: str | None = None) -> dict[str, Any]:
    headers = {"x-session-id": session} if session else {}
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{BASE}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return {
        "replica": r.headers[REPLICA_HEADER],
        "text": out["choices"][0]["message"]["content"],
        "prompt_tokens": out["usage"]["prompt_tokens"],
        "cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def probe(encoder, messages: list[dict]) -> dict[str, int]:
    """What a request router expects each replica's prefix cache to serve of ``messages``."""
    from cb_serve import SamplingParams, prefix_block_hashes
    from cb_serve.serve.engine_request import EngineRequest

    token_ids = encoder.encode_chat(messages)
    request = EngineRequest(
        request_id=f"probe-{uuid.uuid4().hex}",
        params=SamplingParams(max_tokens=1),
        prompt_token_ids=token_ids[:1],
        block_size=ENGINE["block_size"],
        block_hashes=b"".join(prefix_block_hashes(token_ids, ENGINE["block_size"])),
    )
    handle = serve.get_deployment_handle("EngineReplica", APP)

    async def send() -> None:
        async for _ in handle.options(stream=True).generate.remote(request):
            pass

    asyncio.run(send())
    return request.expected_hit_tokens or {}


def wait_until_known(encoder, messages: list[dict], replica: str, tokens: int) -> None:
    """Until the request routers' reports say ``replica`` holds ``tokens`` of ``messages``: this process's
    router hears it, then a grace of a few report periods for the Router deployment's, which gets the same
    report by its own long poll, up to a period apart."""
    wait_for(
        f"{replica} to report {tokens} cached tokens", lambda: probe(encoder, messages).get(replica, 0) >= tokens, 60
    )
    time.sleep(3 * ROUTING_STATS_PERIOD_S)


@pytest.mark.timeout(600)
def test_follow_up_turns_land_on_the_replica_holding_the_conversation(app, encoder, reference):
    topics = [f"topic-{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    first = {}
    for topic in topics:  # each conversation its own system prompt: nothing shared between them
        first[topic] = chat(conversation(topic, 1, system=f"{topic}. {SYSTEM}"))
    for topic in topics:
        turn2 = conversation(topic, 2, system=f"{topic}. {SYSTEM}")
        known = (first[topic]["prompt_tokens"] - 1) // 16 * 16 - 16  # its first turn, less the last block
        wait_until_known(encoder, turn2, first[topic]["replica"], known)
        second = chat(turn2, max_tokens=6)
        assert second["replica"] == first[topic]["replica"], (topic, first[topic], second)
        assert second["cached_tokens"] >= known, (topic, second)
        assert second["text"] == reference(turn2, 6)  # a prefix hit changes nothing of the output


@pytest.mark.timeout(600)
def test_a_hot_prefix_does_not_overload_one_replica(app, encoder):
    """Every request shares a long system prompt that one replica holds: a burst still spreads."""
    system = f"hot-{uuid.uuid4().hex[:6]}. {SYSTEM}"
    warm = chat(conversation("warm-up", system=system))
    wait_until_known(encoder, conversation("anything", system=system), warm["replica"], 128)

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            rs = await asyncio.gather(
                *(
                    c.post(
                        f"{BASE}/v1/chat/completions", json={**body, "messages": conversation(f"q{i}", system=system)}
                    )
                    for i in range(12)
                )
            )
        assert all(r.status_code == 200 for r in rs)
        return [r.headers[REPLICA_HEADER] for r in rs]

    counts = Counter(asyncio.run(burst()))
    assert len(counts) == 2 and min(counts.values()) >= 4, f"a hot prefix piled up on one replica: {counts}"


@pytest.mark.timeout(600)
def test_a_replica_that_lost_the_prefix_still_answers_correctly(app, encoder, reference):
    """A session's first turn pins its replica; unrelated long prompts then evict the
    conversation from both caches; the next turn still goes to the session's replica, which no
    longer holds the prefix, and is computed in full with the same output."""
    session = f"s-{uuid.uuid4().hex}"
    topic = f"evicted-{uuid.uuid4().hex[:6]}"
    first = chat(conversation(topic, 1), session=session)
    turn2 = conversation(topic, 2)
    # Reports lag by up to a few periods, so "not reported yet" must not pass for "evicted".
    wait_until_known(encoder, turn2, first["replica"], (first["prompt_tokens"] - 1) // 16 * 16 - 16)

    def evicted() -> bool:  # a replica missing from the answer (its report late) proves nothing
        return probe(encoder, turn2).get(first["replica"], 10**9) < 128

    for i in range(40):  # ~500 tokens each through two 1536-token caches, spread by load
        chat([{"role": "user", "content": f"filler {i} {uuid.uuid4().hex} " + "unrelated words " * 150}])
        if evicted():
            break
    wait_for("the eviction to be reported", evicted, 60)
    time.sleep(2 * 0.5 + 0.5)  # the fillers' own load leaves the replicas' next reports (no assertion on it)
    second = chat(turn2, max_tokens=6, session=session)
    assert second["replica"] == first["replica"]
    assert second["cached_tokens"] < first["prompt_tokens"] - 16  # at most the shared system prompt was left
    assert second["text"] == reference(turn2, 6)


@pytest.mark.timeout(600)
def test_greedy_output_is_the_same_whichever_replica_serves(app, reference):
    messages = conversation(f"same-{uuid.uuid4().hex[:6]}", 2)

    async def copies() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            rs = await asyncio.gather(*(c.post(f"{BASE}/v1/chat/completions", json=body) for _ in range(6)))
        return [(r.headers[REPLICA_HEADER], r.json()["choices"][0]["message"]["content"]) for r in rs]

    served = asyncio.run(copies()) + asyncio.run(copies())  # the second round mostly hits the cache
    assert len({replica for replica, _ in served}) == 2, served
    assert {text for _, text in served} == {reference(messages, 8)}


@pytest.mark.timeout(600)
def test_a_restarted_replica_is_known_to_be_empty_from_its_first_report(app, encoder):
    """Kill the replica holding a conversation: Serve starts a new one, whose every report (the
    first included) says its cache is empty, so no request is routed there for a hit it lacks."""
    topic = f"restart-{uuid.uuid4().hex[:6]}"
    first = chat(conversation(topic, 1, system=f"{topic}. {SYSTEM}"))
    turn2 = conversation(topic, 2, system=f"{topic}. {SYSTEM}")
    wait_until_known(encoder, turn2, first["replica"], 128)
    before = engine_replica_pids(APP)
    os.kill(before[first["replica"]], signal.SIGKILL)
    new = wait_for("a replacement replica", lambda: set(engine_replica_pids(APP)) - set(before), 240)
    (new_replica,) = new
    seen = wait_for(
        "the router's first report from the new replica",
        lambda: probe(encoder, turn2).get(new_replica) is not None,
        240,
    )
    assert seen is True
    for _ in range(3):
        predictions = probe(encoder, turn2)
        assert predictions.get(new_replica, 0) == 0 and first["replica"] not in predictions, predictions
    second = chat(turn2)
    assert second["replica"] in engine_replica_pids(APP)
