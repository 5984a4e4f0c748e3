"""Fault tests with real processes (reliability issue, 8.1 and 8.3-8.5, and item 6): two
engine replicas of a tiny random-weight Llama behind the Router, on a local Ray instance with
Serve's proxy on 127.0.0.1. Faults are real: a replica's worker process gets SIGKILL, and the
engine's fault-injection hook makes requests, steps or the whole engine fail. Every wait is
bounded; the figures the closing note quotes are printed (``pytest -s``).

Opt-in longer runs: ``CB_SERVE_FUZZ_EXAMPLES`` (default 200) and ``CB_SERVE_SOAK_SECONDS``
(default 20)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from models import make_random_model
from serving import (
    SSEStream,
    engine_replica_pids,
    local_ray_serve,
    rss_mib,
    run_app,
    running_engine_replicas,
    wait_for,
)

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PORT = 8322
BASE = f"http://127.0.0.1:{PORT}"
APP = "faults"
# Prompts that carry these markers fail (or run slowly: 0.1 s a step) on purpose.
FAULTS = "request:REQUEST_FAULT,step:STEP_FAULT,fatal:FATAL_FAULT,slow:SLOW_STREAM"
MAX_TOKENS_CAP = 256
GRACEFUL_S = 2.0
FUZZ_EXAMPLES = int(os.environ.get("CB_SERVE_FUZZ_EXAMPLES", "200"))
SOAK_SECONDS = float(os.environ.get("CB_SERVE_SOAK_SECONDS", "20"))
INTERNALS = ("Traceback", 'File "', ".py", "ActorID", "actor_id", "ray::", "site-packages")


def app_args(model_dir, num_replicas: int = 2) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "engine": {
            "max_model_len": 512,
            "num_gpu_blocks": 512,
            "max_num_seqs": 16,
            "num_threads": 1,
            "fault_injection": FAULTS,
        },
        "router": {"max_tokens_cap": MAX_TOKENS_CAP},
        "routing_stats_period_s": 0.2,
        "engine_replica": {
            "num_replicas": num_replicas,
            "health_check_period_s": 1,
            "health_check_timeout_s": 10,
            "graceful_shutdown_timeout_s": GRACEFUL_S,
            "ray_actor_options": {"num_cpus": 1},
        },
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return make_random_model(tmp_path_factory.mktemp("llama-faults"), "llama", tokenizer)


@pytest.fixture(scope="module")
def app(model_dir):
    with local_ray_serve(PORT, num_cpus=6):
        run_app(app_args(model_dir), APP)
        yield model_dir


def two_live_replicas() -> dict[str, int]:
    """Waits until the app has two RUNNING engine replicas whose engines answer; their pids."""
    wait_for("two running engine replicas", lambda: running_engine_replicas(APP) == 2, 240)
    pids = wait_for("two replica actors", lambda: (p := engine_replica_pids(APP)) and len(p) == 2 and p, 60)
    wait_for("/health", lambda: httpx.get(f"{BASE}/health", timeout=10).status_code == 200, 60)
    return pids


def complete(prompt: str = "hello", max_tokens: int = 4, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{BASE}/v1/completions", json=body, timeout=60)


def assert_clean_error(r: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert error["type"] == kind and error["code"] == status, error
    assert not any(s in r.text for s in INTERNALS), r.text[:300]
    return error


def long_body(i: int, max_tokens: int) -> dict[str, Any]:
    """A slow stream (0.1 s a step): it outlasts a kill, a fault or a shutdown."""
    return {"prompt": f"SLOW_STREAM {i}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


# ---- 8.4: property-based fuzzing of request bodies ------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12))
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8
)
small = st.integers(1, 6)
COMMON = {
    "max_tokens": st.one_of(small, values),
    "temperature": st.one_of(st.floats(0, 2), values),
    "top_p": st.one_of(st.floats(0, 1), values),
    "top_k": st.one_of(st.integers(-3, 2**64), values),
    "min_p": st.one_of(st.floats(0, 1), values),
    "n": st.one_of(st.integers(0, 18), values),
    "seed": st.one_of(st.integers(-(2**65), 2**65), values),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=6), max_size=70), values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 60_000), max_size=4), values),
    "min_tokens": st.one_of(st.integers(-1, 8), values),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True}), values),
    "logit_bias": st.one_of(st.just({}), values),
    "presence_penalty": st.one_of(st.just(0), st.floats(-3, 3), values),
    "ignore_eos": st.one_of(st.booleans(), values),
    "model": st.one_of(st.just("tiny"), st.text(max_size=5)),
    "response_format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), values),
}
PROMPT = st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 60_000), max_size=6), values)
COMPLETION = {
    **COMMON,
    "prompt": PROMPT,
    "logprobs": st.one_of(st.integers(-1, 22), values),
    "echo": st.booleans(),
    "best_of": st.one_of(st.integers(0, 4), values),
    "suffix": st.one_of(st.text(max_size=3), values),
}
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"])},
        optional={
            "content": st.one_of(
                st.text(max_size=12),
                values,
                st.just([{"type": "text", "text": "hi"}]),
                st.just([{"type": "image_url", "image_url": {"url": "u"}}]),
            ),
            "name": values,
            "tool_calls": values,
        },
    ),
    max_size=3,
)
CHAT = {
    **COMMON,
    "messages": st.one_of(messages, values),
    "logprobs": st.one_of(st.booleans(), values),
    "top_logprobs": st.one_of(st.integers(-1, 22), values),
    "tools": values,
    "tool_choice": values,
    "max_completion_tokens": st.one_of(small, values),
}


def mutations(base: dict[str, Any], fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A valid body with up to four of its fields replaced or added (valid values or hostile ones)."""
    keys = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: fields[k] for k in ks})).map(lambda m: {**base, **m})


completion_bodies = mutations({"prompt": "fuzz", "max_tokens": 4}, COMPLETION)
chat_bodies = mutations({"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 4}, CHAT)
raw_bodies = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode))


def check_answer(r: httpx.Response) -> None:
    """2xx, or a 4xx with an OpenAI error object; never a 5xx, never internals."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    assert not any(s in r.text for s in INTERNALS), r.text[:300]
    if r.status_code >= 400:
        error = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error) and error["code"] == r.status_code, error
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        assert not any('"error"' in e[:12] for e in events), r.text[:300]


def test_fuzzed_bodies_get_2xx_or_4xx_and_the_engine_still_serves(app):
    seen: Counter[int] = Counter()
    with httpx.Client(base_url=BASE, timeout=60) as client:

        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            st.one_of(
                completion_bodies.map(lambda b: ("/v1/completions", b)),
                chat_bodies.map(lambda b: ("/v1/chat/completions", b)),
                raw_bodies.map(lambda b: ("/v1/completions", b)),
            )
        )
        def one(case: tuple[str, Any]) -> None:
            path, body = case
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = client.post(path, content=content, headers={"content-type": "application/json"})
            seen[r.status_code] += 1
            check_answer(r)

        one()
    print(f"\nfuzz: {sum(seen.values())} bodies, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= FUZZ_EXAMPLES and seen[200] > 0 and seen[400] > 0
    assert complete().status_code == 200, "the engine still serves"


# ---- 8.3 (per request, per step): injected engine faults -------------------------------------------------------
def test_a_request_fault_fails_only_that_request(app):
    two_live_replicas()

    async def scenario():
        async with httpx.AsyncClient(base_url=BASE, timeout=60) as client:
            healthy = [
                asyncio.create_task(SSEStream().run(client, "/v1/completions", long_body(i, 40))) for i in range(4)
            ]
            await asyncio.sleep(0.3)
            bad = await client.post("/v1/completions", json={"prompt": "REQUEST_FAULT", "max_tokens": 8})
            return bad, await asyncio.gather(*healthy)

    bad, healthy = asyncio.run(asyncio.wait_for(scenario(), 120))
    error = assert_clean_error(bad, 500, "internal_error")
    assert f"request id: {bad.headers['x-request-id']}" in error["message"]  # the proxy's id, as no client set one
    assert all(s.done and s.error is None and s.finish_reasons == ["length"] for s in healthy), healthy
    assert complete().status_code == 200


def test_a_step_fault_fails_that_steps_requests_with_503_and_later_ones_succeed(app):
    two_live_replicas()
    r = complete("STEP_FAULT", 8)
    assert_clean_error(r, 503, "service_unavailable")
    assert r.headers["retry-after"] == "1"
    assert all(complete(f"after {i}").status_code == 200 for i in range(6))


# ---- 8.5: a bounded soak: mixed load, disconnects, aborts; nothing leaks ----------------------------------------
async def soak_worker(client: httpx.AsyncClient, rng: random.Random, deadline: float, outcomes: Counter) -> None:
    while time.monotonic() < deadline:
        kind = rng.choice(["complete", "stream", "disconnect", "abort", "chat", "hostile"])
        tokens = rng.randint(1, 48)
        body = {
            "prompt": f"soak {rng.random()}",
            "max_tokens": tokens,
            "temperature": rng.choice([0, 0.8]),
            "ignore_eos": True,
        }
        try:
            if kind == "complete":
                r = await asyncio.wait_for(client.post("/v1/completions", json=body), 60)
                outcomes["ok" if r.status_code == 200 else f"unexpected {r.status_code}"] += 1
            elif kind in ("stream", "disconnect"):
                stop_after = rng.randint(1, 5) if kind == "disconnect" else 0
                s = await asyncio.wait_for(SSEStream().run(client, "/v1/completions", body, stop_after), 60)
                ended = s.done or (stop_after and s.chunks >= min(stop_after, tokens))
                outcomes["ok" if ended and not s.error and not s.cut else f"unexpected {s}"] += 1
            elif kind == "abort":  # the client gives up mid-request: the server must abort it
                try:
                    await asyncio.wait_for(
                        client.post("/v1/completions", json={**body, "max_tokens": 100}), rng.uniform(0.02, 0.3)
                    )
                    outcomes["ok"] += 1
                except asyncio.TimeoutError:
                    outcomes["aborted"] += 1
            elif kind == "chat":
                chat = {"messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": tokens, "n": 2}
                s = await asyncio.wait_for(SSEStream().run(client, "/v1/chat/completions", chat), 60)
                outcomes["ok" if s.done and not s.error else f"unexpected {s}"] += 1
            else:
                r = await asyncio.wait_for(client.post("/v1/completions", json={**body, "top_p": 7}), 60)
                outcomes["rejected" if r.status_code == 400 else f"unexpected {r.status_code}"] += 1
        except asyncio.TimeoutError:
            outcomes["lost"] += 1  # no final answer within 60 s


def replica_stats() -> dict[str, dict[str, Any]]:
    """Engine counters of every replica (``/stats`` answers from one; ask until each has answered)."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(60):
        s = httpx.get(f"{BASE}/stats", timeout=30).json()
        seen[s["replica"]] = s
        if len(seen) == 2:
            break
    return seen


def test_soak_mixed_load_with_disconnects_leaks_nothing(app):
    pids = two_live_replicas()
    rss_before = {r: rss_mib(p) for r, p in pids.items()}
    outcomes: Counter[str] = Counter()

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=BASE, timeout=60) as client:
            deadline = time.monotonic() + SOAK_SECONDS
            await asyncio.gather(*(soak_worker(client, random.Random(i), deadline, outcomes) for i in range(8)))

    asyncio.run(asyncio.wait_for(scenario(), SOAK_SECONDS + 120))

    def settled() -> dict[str, dict[str, Any]] | None:
        stats = replica_stats()
        ok = len(stats) == 2 and all(
            s["kv_blocks_used"] == s["num_running"] == s["num_waiting"] == 0 for s in stats.values()
        )
        return stats if ok else None

    stats = wait_for("both replicas idle with no KV block in use", settled, 60)
    rss_after = {r: rss_mib(p) for r, p in pids.items()}
    growth = {
        r[:8]: f"{rss_before[r]:.0f} -> {rss_after[r]:.0f} MiB ({rss_after[r] - rss_before[r]:+.0f})" for r in pids
    }
    served = {r[:8]: s["generation_tokens"] for r, s in stats.items()}
    print(
        f"\nsoak {SOAK_SECONDS:.0f} s: {sum(outcomes.values())} requests {dict(outcomes)}; KV blocks in use after: "
        f"{[s['kv_blocks_used'] for s in stats.values()]}; tokens per replica {served}; RSS {growth}"
    )
    unexpected = {k: v for k, v in outcomes.items() if k not in ("ok", "aborted", "rejected")}
    assert not unexpected, f"every request got a final answer or its error: {unexpected}"
    # Work of every kind happened (how much depends on the CPU, and on what else runs on it: no rate here).
    assert outcomes["ok"] >= 10 and outcomes["aborted"] > 0 and outcomes["rejected"] > 0


# ---- 8.1: SIGKILL of a replica's worker process with six streams in flight --------------------------------------
def test_a_killed_replica_fails_only_its_streams_and_is_replaced(app):
    pids = two_live_replicas()

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=BASE, timeout=120) as client:
            streams = [SSEStream() for _ in range(6)]
            body = [long_body(i, 64) for i in range(6)]
            tasks = [asyncio.create_task(s.run(client, "/v1/completions", b)) for s, b in zip(streams, body)]
            await asyncio.wait_for(asyncio.gather(*(s.first_chunk.wait() for s in streams)), 60)
            on = Counter(s.replica for s in streams)
            victim = max(on, key=on.get)
            os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            after = []
            oai = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="none", max_retries=0, timeout=60)
            for i in range(10):  # sent right after the kill, one at a time
                try:
                    raw = await oai.completions.with_raw_response.create(
                        model="tiny", prompt=f"after kill {i}", max_tokens=4
                    )
                    after.append(("ok", raw.headers["x-cb-replica"], time.monotonic() - killed_at))
                except openai.APIStatusError as e:
                    after.append((e.status_code, e.body, time.monotonic() - killed_at))
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return {"streams": streams, "victim": victim, "killed_at": killed_at, "after": after}

    r = asyncio.run(asyncio.wait_for(scenario(), 180))
    victim, killed_at = r["victim"], r["killed_at"]
    dead = [s for s in r["streams"] if s.replica == victim]
    alive = [s for s in r["streams"] if s.replica != victim]
    end_s = max(s.ended_at - killed_at for s in dead)
    failed_after = [a for a in r["after"] if a[0] != "ok"]
    # Ray Serve replaces the killed replica: a request is served by a replica that did not exist before.
    new = wait_for(
        "a replacement replica serving",
        lambda: (rep := complete().headers.get("x-cb-replica")) not in pids and rep,
        240,
        interval=1,
    )
    back_s = time.monotonic() - killed_at
    print(
        f"\nkill: {len(dead)} streams on the killed replica ended within {end_s:.2f} s (error events: "
        f"{sum(s.error is not None for s in dead)}, [DONE]: {sum(s.done for s in dead)}); {len(alive)} on the other "
        f"finished: {sum(s.finish_reasons == ['length'] for s in alive)}; requests after the kill: 10 sent, "
        f"{len(failed_after)} failed {[a[0] for a in failed_after]}; replacement {new[:8]} serving after "
        f"{back_s:.1f} s"
    )
    assert dead and end_s < 30, "the killed replica's streams end with an error within 30 s"
    for s in dead:
        assert s.done and s.error is not None and s.error["code"] == 503, s
        assert not any(x in json.dumps(s.error) for x in INTERNALS), s.error
    assert all(s.done and s.error is None and s.finish_reasons == ["length"] for s in alive), alive
    ok = [a for a in r["after"] if a[0] == "ok"]
    assert all(a[1] != victim for a in ok)
    assert len(failed_after) <= 2 and all(a[0] == 503 for a in failed_after), failed_after
    assert running_engine_replicas(APP) == 2


# ---- 8.3 (fatal): the engine cannot go on ------------------------------------------------------------------------
def test_a_fatal_engine_fault_makes_the_replica_skipped_unhealthy_and_replaced(app):
    before = set(two_live_replicas())
    started = time.monotonic()
    assert_clean_error(complete("FATAL_FAULT", 8), 503, "service_unavailable")
    # At once, before any routing report: the router marked the replica when its request failed
    # (and a replica that refuses a request for a dead engine makes the router try another).
    later = [complete(f"after fatal {i}") for i in range(10)]
    assert [r.status_code for r in later] == [200] * 10, [r.text[:300] for r in later if r.status_code != 200]
    assert len({r.headers["x-cb-replica"] for r in later}) == 1
    assert httpx.get(f"{BASE}/health", timeout=30).status_code == 200, "one live replica: healthy"
    replaced = wait_for(
        "the dead replica replaced",
        lambda: len(set(engine_replica_pids(APP)) - before) == 1 and running_engine_replicas(APP) == 2,
        240,
        interval=1,
    )
    print(
        f"\nfatal: dead replica skipped at once (10/10 later requests served), replaced after "
        f"{time.monotonic() - started:.1f} s"
    )
    assert replaced


# ---- item 6: redeploy with streams in flight -------------------------------------------------------------------
def test_redeploy_drains_old_replicas_and_ends_open_streams_with_an_error_event(app):
    """``serve.run`` again (a new version: Serve starts the new replica, then stops the old ones
    with ``graceful_shutdown_timeout_s``, as on downscale or SIGTERM): short streams finish,
    streams still open when the timeout ends get an in-band error event and [DONE], requests
    sent meanwhile succeed. Leaves the app with one replica."""
    before = set(two_live_replicas())
    from ray import serve

    from cb_serve.serve.app import build_app

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=BASE, timeout=120) as client:
            longs = [SSEStream() for _ in range(4)]
            shorts = [SSEStream() for _ in range(4)]
            tasks = [
                asyncio.create_task(s.run(client, "/v1/completions", long_body(i, 256))) for i, s in enumerate(longs)
            ]
            tasks += [
                # 4 slow steps: done well inside the old replicas' graceful window, even on a loaded machine
                asyncio.create_task(s.run(client, "/v1/completions", long_body(10 + i, 4)))
                for i, s in enumerate(shorts)
            ]
            await asyncio.wait_for(asyncio.gather(*(s.first_chunk.wait() for s in longs + shorts)), 60)
            started = time.monotonic()
            args = app_args(app, num_replicas=1)
            args["router"] = {**args["router"], "served_model_name": "tiny"}
            during: list[int] = []

            async def probe() -> None:  # requests sent while the old replicas drain
                while not all(t.done() for t in tasks) and time.monotonic() - started < 90:
                    body = {"prompt": f"during {len(during)}", "max_tokens": 2}
                    during.append((await client.post("/v1/completions", json=body)).status_code)
                    await asyncio.sleep(0.5)

            probing = asyncio.create_task(probe())
            await asyncio.to_thread(serve.run, build_app(args), name=APP, route_prefix="/", blocking=False)
            await probing
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return {"longs": longs, "shorts": shorts, "started": started, "during": during}

    r = asyncio.run(asyncio.wait_for(scenario(), 180))
    wait_for(
        "the new replica alone", lambda: len(p := engine_replica_pids(APP)) == 1 and set(p).isdisjoint(before), 120
    )
    cut = [s for s in r["longs"] if s.error is not None]
    print(
        f"\nredeploy: long streams cut after {[round(s.ended_at - r['started'], 1) for s in cut]} s "
        f"(graceful_shutdown_timeout_s={GRACEFUL_S}), each with an error event "
        f"{sorted({s.error['type'] for s in cut})} and [DONE]: {all(s.done for s in cut)}; short streams finished "
        f"{sum(s.finish_reasons == ['length'] for s in r['shorts'])}/4; {len(r['during'])} requests during the "
        f"redeploy: {Counter(r['during'])}"
    )
    assert all(s.done and not s.cut for s in r["longs"] + r["shorts"]), "every stream ends with [DONE]: no hang, no cut"
    assert all(s.error is None and s.finish_reasons == ["length"] for s in r["shorts"]), "in-flight streams finish"
    assert cut, "the long streams outlast the old replicas' graceful shutdown"
    for s in cut:
        assert s.error["code"] == 503 and s.error["type"] == "service_unavailable", s.error
        assert not any(x in json.dumps(s.error) for x in INTERNALS), s.error
    assert set(r["during"]) == {200}, "requests during the redeploy go to live replicas"


# ---- README: GET /health is 503 when no engine replica is alive ------------------------------------------------
def test_health_is_503_when_the_only_replica_is_dead(app):
    """One replica whose health checks are far apart (so Ray Serve does not replace it during
    the test): a fatal fault kills its engine, and ``/health`` answers 503 until it is replaced."""
    args = app_args(app, num_replicas=1)
    args["engine_replica"] |= {"health_check_period_s": 60, "health_check_timeout_s": 30}
    run_app(args, APP)
    wait_for("/health", lambda: httpx.get(f"{BASE}/health", timeout=10).status_code == 200, 120)
    assert_clean_error(complete("FATAL_FAULT", 8), 503, "service_unavailable")
    r = httpx.get(f"{BASE}/health", timeout=30)
    assert r.status_code == 503 and r.json()["status"] == "unavailable", r.text
    assert_clean_error(complete("after the only replica died"), 503, "service_unavailable")
