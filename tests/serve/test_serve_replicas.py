"""Several engine replicas behind the Router, started through the Python API
(``serve.run(build_app(...))``) on 127.0.0.1 with a tiny random-weight model, and called
with the real ``openai`` client: load-aware routing across replicas (issue 3, acceptance 3)
and fast, well-formed overload answers (acceptance 6). Every wait is bounded."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest
from models import make_random_model
from serving import REPLICA_HEADER, SHARED_PORT, local_ray_serve, run_app, running_engine_replicas

serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
# The routing test's fast autoscaling needs AutoscalingConfig.metrics_interval_s (deprecated in favour of env vars).
pytestmark = pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")

PORT = SHARED_PORT  # one Ray cluster for these modules (serving.SHARED_CLUSTER_MODULES)
BASE = f"http://127.0.0.1:{PORT}"
MAX_MODEL_LEN = 4096  # long requests must outlast a new replica's start on a busy 2-core machine


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory, tokenizer):
    """A tiny random-weight Llama with a 4096-token context (fast, and long requests stay long)."""
    return make_random_model(
        tmp_path_factory.mktemp("llama-4k"), "llama", tokenizer, max_position_embeddings=MAX_MODEL_LEN
    )


@pytest.fixture(scope="module")
def ray_serve():
    """A fresh local Ray instance with Serve's HTTP proxy on 127.0.0.1:PORT; shut down after."""
    with local_ray_serve(PORT) as s:
        yield s


def client() -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="none", timeout=120, max_retries=0)


async def short_request(c: openai.AsyncOpenAI, i: int, max_tokens: int = 4) -> str:
    """One non-streaming completion; returns the engine replica that served it."""
    raw = await c.completions.with_raw_response.create(
        model="tiny", prompt=f"short request {i}", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    assert raw.parse().usage.completion_tokens == max_tokens
    return raw.headers[REPLICA_HEADER]


class LongStream:
    """A streaming request that keeps its replica busy until closed."""

    def __init__(self, c: openai.AsyncOpenAI, i: int) -> None:
        self.client, self.i, self.chunks, self.finished = c, i, 0, False

    async def start(self) -> str:
        self.stream = await self.client.completions.create(
            model="tiny",
            prompt=f"long request {self.i}",
            max_tokens=MAX_MODEL_LEN - 16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        self.task = asyncio.create_task(self._consume())
        return self.stream.response.headers[REPLICA_HEADER]

    async def _consume(self) -> None:
        async for chunk in self.stream:
            self.chunks += 1
            self.finished = self.finished or chunk.choices[0].finish_reason is not None

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.stream.close()  # the engine aborts the request


def test_load_formula_and_tie_order():
    from cb_serve.serve.request_router import order_by_load, replica_load
    from cb_serve.serve.routing_report import ReplicaReport

    stats = ReplicaReport(
        kv_cache_usage=0.5, num_waiting_tokens=512, token_budget=1024, num_requests=2, max_num_seqs=8, time=0.0
    )
    assert replica_load(stats, 2) == pytest.approx(0.5 + 0.5 + (2 + 2) / 8)
    older = ReplicaReport.from_dict({"num_running": 1, "num_waiting": 1, "max_num_seqs": 4, "unknown": 1})
    assert replica_load(older, 0) == 0.5  # no num_requests
    loads = {"a": 0.0, "b": 0.015, "c": 0.03, "d": 0.5}  # a~b and b~c tie, but c is more than TIE above a
    assert {tuple(order_by_load(loads)) for _ in range(200)} == {("a", "b", "c", "d"), ("b", "a", "c", "d")}


def test_stale_and_dead_replicas_are_ranked_last():
    """README's routing rules: no report or one that arrived more than ``stale_after_s`` ago is stale, tried only
    after every fresh replica (as one rank: Ray Serve picks among them); a dead replica (it said
    so, or a router marked it after its report) only when there is nothing else."""
    from cb_serve.serve.request_router import rank_replicas, replica_state
    from cb_serve.serve.routing_report import ReplicaReport

    now, stale_after, one = 100.0, 10.0, ReplicaReport(seq=1)
    assert replica_state(one, 95.0, now, stale_after, False) == "fresh"
    assert replica_state(one, 89.0, now, stale_after, False) == "stale"
    assert replica_state(ReplicaReport.from_dict(None), None, now, stale_after, False) == "stale"  # no report yet
    assert replica_state(ReplicaReport(seq=1, alive=False), 99.0, now, stale_after, False) == "dead"
    assert replica_state(one, 99.0, now, stale_after, True) == "dead"
    assert rank_replicas(["idle", "busy"], ["old", "new"], ["gone"]) == [["idle"], ["busy"], ["old", "new"]]
    assert rank_replicas([], ["old"], ["gone"]) == [["old"]]
    assert rank_replicas([], [], ["gone"]) == [["gone"]]
    assert rank_replicas([], [], []) == []


@pytest.mark.timeout(600)
def test_new_requests_go_to_the_idle_replica_and_equal_load_is_shared(ray_serve, long_model_dir):
    name = "routing"
    # One replica to start with; it autoscales to two once the long requests are ongoing.
    run_app(
        {
            "model": str(long_model_dir),
            "engine": {
                "max_model_len": MAX_MODEL_LEN,
                "num_gpu_blocks": 1100,
                "max_num_seqs": 4,
                "max_num_batched_tokens": 256,
                "num_threads": 1,
            },
            "routing_stats_period_s": 0.2,
            "engine_replica": {
                "autoscaling_config": {
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 1,
                    "upscale_delay_s": 0,
                    "downscale_delay_s": 600,
                    "metrics_interval_s": 0.2,
                    "look_back_period_s": 1,
                },
                "ray_actor_options": {"num_cpus": 1},
            },
        },
        name,
    )
    assert running_engine_replicas(name) == 1

    async def scenario() -> dict[str, Any]:
        c = client()
        longs = [LongStream(c, i) for i in range(3)]
        busy = {await s.start() for s in longs}
        assert len(busy) == 1, "with one replica every long request is on it"
        (busy_replica,) = busy
        try:
            deadline = time.monotonic() + 240
            while await asyncio.to_thread(running_engine_replicas, name) < 2:
                assert time.monotonic() < deadline, "the second engine replica did not start"
                await asyncio.sleep(0.5)
            # Until the router has the new replica's first load report, that replica ranks last:
            # probe (bounded) until one request lands there, then count.
            probes: list[str] = []
            while not probes or probes[-1] == busy_replica:
                assert time.monotonic() < deadline, f"no request reached the new replica: {probes}"
                probes.append(await short_request(c, len(probes)))
                await asyncio.sleep(0.3)
            shorts = []
            for i in range(8):  # one at a time, a little apart, so each sees a fresh report
                shorts.append(await short_request(c, 100 + i))
                await asyncio.sleep(0.4)
            still_running = [not s.finished and not s.task.done() for s in longs]
        finally:
            for s in longs:
                await s.close()
        await asyncio.sleep(2.0)  # aborted: both replicas idle again, their reports say so
        burst = await asyncio.gather(*(short_request(c, 200 + i, max_tokens=32) for i in range(16)))
        return {
            "busy": busy_replica,
            "probes": probes,
            "shorts": shorts,
            "alive": still_running,
            "burst": burst,
            "long_chunks": [s.chunks for s in longs],
        }

    r = asyncio.run(asyncio.wait_for(scenario(), timeout=420))
    print(r)
    assert all(r["alive"]), f"the long requests must still be running while the short ones are sent: {r}"
    on_busy = Counter(r["shorts"])[r["busy"]]
    assert on_busy <= 1, f"new requests must go to the idle replica, {on_busy}/8 went to the busy one: {r}"
    burst = Counter(r["burst"])
    assert len(burst) == 2 and min(burst.values()) >= 4, f"with equal load both replicas get work: {burst}"


CAPACITY = 4  # each case admits exactly 4 of a burst: 2 running + 2 waiting, or 2 ongoing + 2 queued
OVERLOAD_CASES = {
    # The engine's waiting queue: 2 running + 2 waiting, the rest refused by the engine.
    "engine_queue": {"engine": {"max_num_seqs": 2, "max_waiting_requests": 2}},
    # Ray Serve's backpressure: 2 ongoing at the replica + 2 queued in the router, the rest refused.
    "serve_queue": {
        "engine": {"max_num_seqs": 8},
        "engine_replica": {"max_ongoing_requests": 2, "max_queued_requests": 2},
    },
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(OVERLOAD_CASES))
def test_overload_is_refused_fast_and_accepted_requests_finish(ray_serve, long_model_dir, case):
    args = OVERLOAD_CASES[case]
    run_app(
        {
            "model": str(long_model_dir),
            "engine": {"max_model_len": 1024, "num_gpu_blocks": 600, "num_threads": 1, **args["engine"]},
            "engine_replica": {"num_replicas": 1, **args.get("engine_replica", {})},
        },
        f"overload-{case.replace('_', '-')}",
    )
    num_requests, max_tokens = 12, 400

    async def one(c: openai.AsyncOpenAI, i: int, running: asyncio.Event | None = None) -> dict[str, Any]:
        try:
            stream = await c.completions.create(
                model="tiny",
                prompt=f"overload {i}",
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        except openai.APIStatusError as e:
            return {
                "status": e.status_code,
                "answered_at": time.monotonic(),
                "body": e.response.json(),
                "retry_after": e.response.headers.get("retry-after"),
            }
        tokens = 0
        async for chunk in stream:
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
            if running is not None:
                running.set()
        return {"status": 200, "answered_at": time.monotonic(), "tokens": tokens}

    async def burst() -> list[dict[str, Any]]:
        """Two requests first, until both stream (the replica is then full: running, or at
        max_ongoing_requests), then the other ten at once: exactly two of those fit the queue.
        (Sent all at once, how many Ray Serve queues depends on how fast it assigns the first two.)"""
        c = client()
        events = [asyncio.Event() for _ in range(2)]
        first = [asyncio.create_task(one(c, i, e)) for i, e in enumerate(events)]
        await asyncio.gather(*(e.wait() for e in events))
        rest = await asyncio.gather(*(one(c, i) for i in range(2, num_requests)))
        return [*await asyncio.gather(*first), *rest]

    sent_at = time.monotonic()
    results = asyncio.run(asyncio.wait_for(burst(), timeout=300))
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    print(case, sorted((r["status"], round(r["answered_at"] - sent_at, 2)) for r in results))
    assert len(accepted) == CAPACITY and len(refused) == num_requests - CAPACITY, results
    assert [r["status"] for r in results[:2]] == [200, 200]
    assert all(r["tokens"] == max_tokens for r in accepted), accepted
    first_finished = min(r["answered_at"] for r in accepted)
    for r in refused:
        assert r["status"] == 503, r
        assert r["body"]["error"]["type"] == "overloaded_error" and r["body"]["error"]["code"] == 503, r
        assert r["retry_after"] == "1", r
        # "At once": refused while the accepted requests still run, not after waiting for a slot.
        assert r["answered_at"] < first_finished, r
    # Afterwards the server takes requests again.
    assert asyncio.run(asyncio.wait_for(short_request(client(), 0), timeout=60))


@pytest.mark.timeout(400)
def test_config_api_key_and_full_replicas_are_skipped(ray_serve, long_model_dir):
    """README claims: ``router.api_key`` in the config requires the key (no environment
    variable involved); a replica at ``max_ongoing_requests`` is skipped for the next one, so two
    concurrent streams on two one-request replicas land on different replicas and both stream."""
    run_app(
        {
            "model": str(long_model_dir),
            "engine": {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks": 600, "num_threads": 1},
            "engine_replica": {"num_replicas": 2, "max_ongoing_requests": 1},
            "router": {"api_key": "config-secret"},
        },
        "config-key",
    )
    for key in ("none", "wrong"):
        with pytest.raises(openai.AuthenticationError):
            asyncio.run(short_request(openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key=key, max_retries=0), 0))

    async def scenario() -> tuple[list[str], list[int]]:
        c = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="config-secret", timeout=120, max_retries=0)
        longs = [LongStream(c, i) for i in range(2)]
        try:
            replicas = list(await asyncio.gather(*(s.start() for s in longs)))
            while min(s.chunks for s in longs) < 3:  # both stream at the same time
                await asyncio.sleep(0.1)
            return replicas, [s.chunks for s in longs]
        finally:
            for s in longs:
                await s.close()

    replicas, chunks = asyncio.run(asyncio.wait_for(scenario(), timeout=240))
    assert len(set(replicas)) == 2, f"both streams went to one replica: {replicas} ({chunks} chunks)"
