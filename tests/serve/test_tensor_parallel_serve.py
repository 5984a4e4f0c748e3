"""Tensor parallelism through Ray Serve on a local Ray instance: ``deploy/config.tp.yaml``'s
engine deployment (its bundles on CPU: this machine has no GPU) serving a tiny random Llama at
``tensor_parallel_size=2``, read with the openai client; then a worker actor killed mid-stream:
the streams end with an error event and Serve replaces the whole replica."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from models import make_random_model
from serving import SHARED_PORT, SSEStream, local_ray_serve, run_app, wait_for

from cb_serve import LLM, SamplingParams

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

PORT = SHARED_PORT  # one Ray cluster for these modules (serving.SHARED_CLUSTER_MODULES)
BASE = f"http://127.0.0.1:{PORT}"
APP = "tp"
CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "config.tp.yaml"
ENGINE = {"max_model_len": 512, "num_gpu_blocks": 256, "max_num_seqs": 8, "num_threads": 1}


def tp_app_args(model_dir: Path) -> dict[str, Any]:
    """config.tp.yaml's application and engine deployment, with the test model and CPU bundles."""
    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    (engine,) = [d for d in app["deployments"] if d["name"] == "EngineReplica"]
    on_cpu = [{"CPU": 1} for _ in engine["placement_group_bundles"]]
    options = {k: engine[k] for k in ("placement_group_strategy", "max_ongoing_requests")}
    return {
        "model": str(model_dir),
        "engine": {
            "tensor_parallel_size": app["args"]["engine"]["tensor_parallel_size"],
            **ENGINE,
            "fault_injection": "slow:SLOW_STREAM",
        },
        "routing_stats_period_s": 0.2,
        "engine_replica": {
            **options,
            "num_replicas": 1,
            "placement_group_bundles": on_cpu,
            "ray_actor_options": {"num_cpus": 1},
            "health_check_period_s": 1,
            "health_check_timeout_s": 10,
            "graceful_shutdown_timeout_s": 1,
        },
    }


@pytest.fixture(scope="module")
def app(tmp_path_factory, tokenizer):
    model_dir = make_random_model(tmp_path_factory.mktemp("llama-tp"), "llama", tokenizer)
    with local_ray_serve(PORT) as serve:
        run_app(tp_app_args(model_dir), APP)
        yield model_dir, serve


def replica_and_workers(serve) -> tuple[str, list[int]]:
    """The serving replica's id (from a response) and its tensor-parallel workers' pids."""
    handle = serve.get_deployment_handle("EngineReplica", APP)
    replica = httpx.post(f"{BASE}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    return replica.headers["x-cb-replica"], handle.worker_pids.remote().result(timeout_s=30)


def test_two_ranks_serve_what_one_rank_generates(app):
    model_dir, serve = app
    prompt = "The capital of France is"
    ref = LLM(str(model_dir), **{k: v for k, v in ENGINE.items() if k != "num_threads"})
    expected = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", max_retries=0, timeout=60)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected
    _, workers = replica_and_workers(serve)
    assert len(workers) == 1


def test_a_killed_worker_fails_the_streams_and_the_replica_is_replaced(app):
    _, serve = app
    replica, (worker,) = replica_and_workers(serve)

    async def scenario() -> list[SSEStream]:
        async with httpx.AsyncClient(base_url=BASE, timeout=120) as client:
            streams = [SSEStream() for _ in range(3)]
            body = [{"prompt": f"SLOW_STREAM {i}", "max_tokens": 200, "ignore_eos": True} for i in range(3)]
            tasks = [asyncio.create_task(s.run(client, "/v1/completions", b)) for s, b in zip(streams, body)]
            await asyncio.wait_for(asyncio.gather(*(s.first_chunk.wait() for s in streams)), 60)
            os.kill(worker, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return streams

    killed_at = time.monotonic()
    streams = asyncio.run(scenario())
    for s in streams:
        assert s.done and s.error is not None and s.error["code"] == 503, s
        assert s.chunks < 200
    new_replica = wait_for(
        "a replacement replica serving",
        lambda: (rep := replica_and_workers(serve))[0] != replica and rep,
        240,
        interval=1,
    )
    assert new_replica[1] and new_replica[1][0] != worker
    print(f"\nworker killed: streams ended with 503, replacement serving after {time.monotonic() - killed_at:.1f} s")
