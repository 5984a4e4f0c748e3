"""Metrics (issue 4). A fast check of what ``EngineMetrics`` records, on an ``AsyncLLM`` with
fake metric classes; then the acceptance test: the Serve application on 127.0.0.1 with Ray's
metrics export port, a real Prometheus scraping it, a known workload through the ``openai``
client on a tiny mixture of experts (so the expert-load series are fed too, issue 39), every
query of the Grafana dashboard run against that Prometheus, and every expression of the
PrometheusRules in k8s/ evaluated by it."""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest
from models import make_adapter
from tools import prometheus_tool

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "cb-serve-dashboard.json"
K8S = ROOT / "k8s"
# Every series the dashboard reads is filtered on the RayCluster (a KubeRay upgrade runs two).
CLUSTER_MATCHER = 'ray_io_cluster=~"$ray_io_cluster"'
# Ray's own series the dashboard shows beside ours (names as Ray 2.60 exports them: Serve's
# controller, handles and node reporter; checked against a live scrape by the stack test).
SERVE_SERIES = (
    "ray_serve_deployment_replica_healthy",
    "ray_serve_autoscaling_target_replicas",
    "ray_serve_autoscaling_desired_replicas",
    "ray_serve_autoscaling_total_requests",
    "ray_serve_autoscaling_target_ongoing_requests",
    "ray_serve_deployment_queued_queries",
    "ray_serve_num_ongoing_requests_at_replicas",
)
GPU_SERIES = ("ray_node_gpus_utilization", "ray_node_gram_used", "ray_node_gram_available")
# Engine metrics nothing feeds yet: Ray exports a counter only after its first (positive) increment.
# Metrics no workload here can feed (name: why).
UNFED_METRICS: dict[str, str] = {
    "triton_compiles": "a CPU engine runs no Triton kernel",
    "images_encoded": "this test's model reads no images (tests/serve/test_vision_serve.py counts them)",
    "encoder_cache_hits": "this test's model reads no images",
    "encoder_seconds": "this test's model reads no images",
    "request_images": "this test's model reads no images",
}
# Forces chunked prefill (budget < prompt), preemption (few blocks) and prefix-cache hits.
ENGINE_ARGS = dict(
    block_size=16,
    max_num_batched_tokens=64,
    num_gpu_blocks=40,
    max_model_len=400,
    max_num_seqs=8,
    attention_backend="torch",
)


class _Fake:
    """Stands in for ray.serve.metrics' Counter / Gauge / Histogram: keeps every value by tags."""

    def __init__(self, name: str, description: str = "", boundaries=None, tag_keys: tuple = ()) -> None:
        self.name, self.boundaries, self.tag_keys = name, boundaries, tag_keys
        self.defaults: dict[str, str] = {}
        self.values: dict[tuple, list[float]] = defaultdict(list)

    def set_default_tags(self, tags: dict[str, str]) -> None:
        self.defaults = dict(tags)

    def _record(self, value: float, tags: dict[str, str] | None = None) -> None:
        full = {**self.defaults, **(tags or {})}
        assert set(full) == set(self.tag_keys), (self.name, full)
        self.values[tuple(sorted(full.items()))].append(value)

    inc = observe = set = _record

    def all(self) -> list[float]:
        return [v for vs in self.values.values() for v in vs]


FAKE_API = type("FakeMetrics", (), {"Counter": _Fake, "Gauge": _Fake, "Histogram": _Fake})


def test_engine_metrics_record_what_the_clients_saw(random_model_dir):
    from cb_serve.config import EngineConfig
    from cb_serve.engine.async_llm import AsyncLLM
    from cb_serve.sampling_params import RequestOutputKind, SamplingParams
    from cb_serve.serve.metrics import EngineMetrics

    engine = AsyncLLM(EngineConfig.from_kwargs(model=str(random_model_dir("llama")), **ENGINE_ARGS))
    metrics = EngineMetrics(engine, "tiny", interval_s=0.05, api=FAKE_API)
    shared = list(range(100, 140))  # 40 shared prompt tokens: 2 full blocks for the prefix cache

    async def one(i: int) -> tuple[int, str]:
        params = SamplingParams(max_tokens=70 + i % 7, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        tokens, reason = 0, None
        async for out in engine.generate(shared + [200 + i] * (5 + i), params, f"r{i}"):
            tokens += sum(len(c.token_ids) for c in out.outputs)
            reason = out.outputs[0].finish_reason or reason
        return tokens, reason

    async def main() -> list[tuple[int, str]]:
        return await asyncio.gather(*(one(i) for i in range(12)))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()  # its last stats snapshot is taken after the last step: close() then reads it
    metrics.close()
    m, stats = metrics.m, engine.get_stats()
    generated = sum(t for t, _ in results)
    assert m["generation_tokens"].all() and sum(m["generation_tokens"].all()) == generated == stats.generation_tokens
    assert sum(m["prompt_tokens"].all()) == sum(45 + i for i in range(12))
    assert len(m["time_to_first_token_seconds"].all()) == len(m["e2e_request_latency_seconds"].all()) == 12
    assert len(m["request_queue_time_seconds"].all()) == 12
    assert len(m["inter_token_latency_seconds"].all()) == generated - 12  # every token after the first
    assert min(m["inter_token_latency_seconds"].all()) >= 0
    length = (("finished_reason", "length"), ("lora_name", ""), ("model", "tiny"), ("model_name", "tiny"))
    assert m["request_success"].values == {length: [1] * 12}
    assert sum(m["num_preemptions"].all()) == stats.num_preemptions > 0
    assert sum(m["prefix_cache_hits"].all()) == stats.prefix_cache_hits > 0
    assert sum(m["prefix_cache_queries"].all()) == stats.prefix_cache_queries
    fills = m["batch_token_fill_ratio"].all()
    assert len(fills) == len(m["batch_num_seqs"].all()) == stats.num_steps
    assert all(0 < f <= 1 for f in fills) and max(m["batch_num_seqs"].all()) > 1
    assert m["kv_cache_blocks_total"].all()[-1] == 40 and 0 <= m["kv_cache_usage_perc"].all()[-1] <= 1
    assert metrics._last_token == {}  # finished requests are forgotten
    for name in ("structured_output_requests", "grammar_compile_seconds", "grammar_bitmask_fill_seconds"):
        assert not m[name].all(), name  # no constrained request (tests/features/test_structured_metrics.py has them)
    assert not m["moe_expert_tokens"].all() and not m["moe_expert_imbalance"].all()  # a dense model
    assert set(m["num_requests_waiting_grammar"].all()) == {0}
    if stats.cpu_kernels:  # the C++ kernels built: the kernel choice is a label
        kernels = (("kernels", stats.cpu_kernels), ("model", "tiny"), ("model_name", "tiny"))
        assert set(m["cpu_kernels_info"].values) == {kernels}
    weights = {dict(tags)["format"]: values[-1] for tags, values in m["model_weight_bytes"].values.items()}
    assert weights == stats.weight_bytes and weights["float32"] > 0  # a random float32 model


def test_an_aborted_request_is_forgotten(random_model_dir):
    """A request aborted after its first tokens sends no finished output; the engine names it in
    the next step's ``StepStats.ended_request_ids``, and the metrics drop its state."""
    from cb_serve import AsyncLLM, EngineConfig, RequestOutputKind, SamplingParams
    from cb_serve.serve.metrics import EngineMetrics

    engine = AsyncLLM(EngineConfig.from_kwargs(model=str(random_model_dir("llama")), **ENGINE_ARGS))
    metrics = EngineMetrics(engine, "tiny", interval_s=0.05, api=FAKE_API)
    params = SamplingParams(max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main() -> None:
        async def leave_early() -> None:
            outputs = 0
            async for _ in engine.generate([5] * 20, params, "leaves"):
                outputs += 1
                if outputs == 3:
                    break  # aborts the request

        async def finish() -> None:
            async for _ in engine.generate([6] * 20, params, "stays"):
                pass

        await asyncio.gather(leave_early(), finish())

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    metrics.close()
    assert metrics._last_token == {}
    assert len(metrics.m["e2e_request_latency_seconds"].all()) == 1  # only the finished one


def test_requests_and_sequences_are_counted_apart(random_model_dir):
    """vLLM's num_requests_running / _waiting count requests (one with n > 1 runs if any of its
    sequences does); num_seqs_running / _waiting count sequences. Room for three sequences: a
    request with n=3 runs (1 request, 3 sequences) while one with n=2 waits (1 request, 2)."""
    from cb_serve import AsyncLLM, EngineConfig, SamplingParams
    from cb_serve.serve.metrics import EngineMetrics

    config = EngineConfig.from_kwargs(model=str(random_model_dir("llama")), **{**ENGINE_ARGS, "max_num_seqs": 3})
    engine = AsyncLLM(config)
    metrics = EngineMetrics(engine, "tiny", interval_s=3600, api=FAKE_API)  # flushed below, by hand
    names = ("num_requests_running", "num_seqs_running", "num_requests_waiting", "num_seqs_waiting")
    seen: list[tuple[float, ...]] = []

    def snapshot() -> tuple[float, ...]:
        metrics.flush()
        return tuple(metrics.m[name].all()[-1] for name in names)

    async def main() -> None:
        async def three() -> None:
            params = SamplingParams(n=3, max_tokens=30, ignore_eos=True)
            async for _ in engine.generate([7] * 20, params, "three"):
                seen.append(snapshot())

        async def two() -> None:
            await asyncio.sleep(0)  # after "three" is in
            async for _ in engine.generate([8] * 20, SamplingParams(n=2, max_tokens=5, ignore_eos=True), "two"):
                pass

        await asyncio.gather(three(), two())

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    metrics.close()
    assert (1, 3, 1, 2) in seen, seen  # "three" running, "two" waiting for room
    assert all(r <= s and w <= ws for r, s, w, ws in seen), seen
    assert tuple(metrics.m[name].all()[-1] for name in names) == (0, 0, 0, 0)
    for name in names:  # both labels, the same value
        assert {dict(tags)["model_name"] for tags in metrics.m[name].values} == {"tiny"}


def hand_fed_metrics():
    """``EngineMetrics`` of an engine that never steps, with no flusher: a test records steps by hand."""
    from cb_serve.serve.metrics import EngineMetrics

    class Engine:
        def add_step_listener(self, listener) -> None: ...

        def add_output_listener(self, listener) -> None: ...

    metrics = EngineMetrics(Engine(), "tiny", interval_s=3600, api=FAKE_API)
    metrics._stop.set()
    return metrics


def test_speculative_decoding_counters_follow_the_steps():
    from cb_serve.stats import StepStats

    metrics = hand_fed_metrics()
    base = dict(num_decode_tokens=15, num_prefill_tokens=0, num_scheduled_tokens=15, token_budget=64, num_preempted=0)
    for drafts, tokens, accepted, per_pos in [(2, 7, 4, (2, 1, 1, 0)), (0, 0, 0, ()), (1, 4, 1, (1, 0, 0, 0))]:
        step = StepStats(num_seqs=4, duration_s=0.01, **base)
        step.num_drafts, step.num_draft_tokens, step.num_accepted_tokens = drafts, tokens, accepted
        step.num_accepted_tokens_per_pos = per_pos
        metrics._record_spec_decode(step)
    m = metrics.m
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    assert [sum(m["spec_decode_" + name].all()) for name in names] == [3, 11, 5]
    per_pos = m["spec_decode_num_accepted_tokens_per_pos"].values.items()
    assert {dict(tags)["position"]: sum(v) for tags, v in per_pos} == {"0": 3, "1": 1, "2": 1}


def test_image_steps_record_the_encoder_s_seconds_and_each_request_s_images():
    """A model that reads images: one encoder-seconds observation per step that encoded, and one
    images-per-request observation per request added (0 for a text request)."""
    from cb_serve.stats import MultiModalStats, StepStats

    metrics = hand_fed_metrics()
    base = dict(num_decode_tokens=0, num_prefill_tokens=8, num_scheduled_tokens=8, token_budget=64, num_preempted=0)
    for mm in [MultiModalStats(2, 0.25, (2, 0)), MultiModalStats(), MultiModalStats(0, 0.0, (1,))]:
        metrics._record_step(StepStats(num_seqs=2, duration_s=0.5, multimodal=mm, **base))
    assert metrics.m["encoder_seconds"].all() == [0.25]  # the step that ran the encoder only
    assert metrics.m["request_images"].all() == [2, 0, 1]


def test_expert_load_is_counted_per_expert_and_its_imbalance_per_step():
    """A mixture of experts: tokens per expert summed over the layers and the flush's steps (one
    increment per expert that had any), and one imbalance observation per step."""
    import numpy as np

    from cb_serve.stats import ExpertLoad, StepStats

    metrics = hand_fed_metrics()
    base = dict(num_decode_tokens=4, num_prefill_tokens=0, num_scheduled_tokens=4, token_budget=64, num_preempted=0)
    balanced = np.array([[2, 2, 2, 2], [2, 2, 2, 2]])  # 4 tokens, top 2, two MoE layers of 4 experts
    skewed = np.array([[4, 4, 0, 0], [8, 0, 0, 0]])  # layer 1 sends every pair to expert 0
    for counts in (balanced, skewed):
        metrics._record_step(StepStats(num_seqs=4, duration_s=0.01, expert_load=ExpertLoad((0, 1), counts), **base))
    metrics._record_step(StepStats(num_seqs=4, duration_s=0.01, **base))  # a dense step: nothing
    metrics._record_expert_tokens()
    m = metrics.m
    by_expert = {dict(tags)["expert"]: sum(v) for tags, v in m["moe_expert_tokens"].values.items()}
    assert by_expert == {"0": 16, "1": 8, "2": 4, "3": 4}  # expert 3 had tokens in the balanced step only
    assert all(len(v) == 1 for v in m["moe_expert_tokens"].values.values())  # one increment per flush
    assert m["moe_expert_imbalance"].all() == [1.0, (4 + 8) / 4]  # busiest over the mean (4 per expert), per layer
    metrics._record_expert_tokens()  # a flush without steps of a mixture of experts adds nothing
    assert all(len(v) == 1 for v in m["moe_expert_tokens"].values.values())


def test_dashboard_is_importable_with_a_datasource_variable():
    from cb_serve.serve.metrics import ENGINE_METRICS, ROUTER_METRICS, exported_name

    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and "id" not in dashboard  # Grafana >= 10 import
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert list(variables) == ["datasource", "ray_io_cluster", "model_name", "replica"]
    for name in ("ray_io_cluster", "model_name", "replica"):
        assert variables[name]["datasource"]["uid"] == "${datasource}" and variables[name]["includeAll"]
        # "All" is the regex .*, which also matches a series without the label (no ray_io_cluster
        # when Prometheus scrapes Ray directly, as below): Grafana's default (a|b|...) would not.
        assert variables[name]["allValue"] == ".*"
    assert variables["ray_io_cluster"]["definition"].endswith(", ray_io_cluster)")
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    text = DASHBOARD.read_text()
    unused = [n for n in ENGINE_METRICS | ROUTER_METRICS if exported_name(n).removesuffix("_total") not in text]
    assert not unused, f"metrics no panel shows: {unused}"
    assert all(name in text for name in SERVE_SERIES + GPU_SERIES)
    for title, expr in dashboard_queries():
        assert not re.search(r"\bmodel=~", expr), f"{title}: filter on model_name (vLLM's label), not model"
        for name, matchers in re.findall(r"\b(ray_[A-Za-z0-9_]+)(\{[^}]*\})?", expr):
            if name != "ray_io_cluster":  # a metric: filtered on the cluster
                assert CLUSTER_MATCHER in matchers, f"{title}: {name} without {CLUSTER_MATCHER}"


# ---- acceptance: Ray's metrics export port -> a real Prometheus -> every dashboard query ----------

N_REQUESTS = 16  # after a warm-up of 4
N_CONSTRAINED = 2  # structured-output requests after them (1 after the warm-up)
CONSTRAINED_SERIES = ("structured_output_requests_total", "grammar_compile_seconds_count")  # +1 per request
# 4 running sequences per replica already preempt. Speculative decoding feeds the spec_decode_*
# series: the model drafts for itself (a draft model with its own KV cache), so every draft is
# accepted and every position counted (a random-weight model never repeats itself: n-gram drafts,
# as tests/serve/test_serve.py serves them, would all be rejected). Set in the fixture: the model is made there.
SERVE_ENGINE_ARGS = {**ENGINE_ARGS, "num_gpu_blocks": 32}
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}
# LoRA feeds the lora_* series: two adapters through one slot (max_loras 1), so they displace each other;
# on the attention projections (adapters on a mixture of experts may not target its experts).
LORA_ENGINE_ARGS = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# The model is a mixture of experts, so the moe_* series are fed too (every other series is the same for a
# dense model): tests/models.py's Qwen3-MoE, layers 0 and 2 sparse (8 experts, top 2), layer 1 dense.
MOE_ARCH, MOE_LAYERS, NUM_EXPERTS, TOP_K = "qwen3_moe", 2, 8, 2
SHARED = "You are a helpful assistant. Answer briefly and precisely, in plain English. " * 3  # > 2 KV blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float, interval: float = 0.5):
    """Polls ``check()`` until it returns a truthy value (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, AssertionError, KeyError, ValueError) as e:
            last = e
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def _die_with_parent() -> None:
    """In the child: get SIGTERM when pytest dies, even if it is killed before its teardown."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except OSError:
        pass


class Prometheus:
    """A real Prometheus (Debian package ``prometheus``) scraping only ``targets`` on loopback
    every second, with its own storage under ``workdir``; stopped by ``stop()``."""

    def __init__(self, binary: str, workdir: Path, targets: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "15s"},
                    "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}],
                }
            )
        )
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        wait_for("Prometheus to be ready", lambda: self.proc.poll() is None and self._ready(), timeout=60)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}"
        return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query (now, or at unix time ``at``): (labels, value) per series."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        assert body["data"]["resultType"] == "vector", expr
        return [(item["metric"], float(item["value"][1])) for item in body["data"]["result"]]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return result[0][1] if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    return prometheus_tool("prometheus")


@pytest.fixture(scope="module")
def stack(prometheus_binary, random_model_dir, tmp_path_factory):
    """Ray on 127.0.0.1 with its metrics export port, the app with two engine replicas on a tiny
    random-weight mixture of experts, and Prometheus scraping that port. Everything is stopped after."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from cb_serve.serve.app import build_app

    metrics_port, http_port = free_port(), free_port()
    env = {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},  # export every second (default 10 s)
        runtime_env={"env_vars": env},
    )
    prometheus = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        model = str(random_model_dir(MOE_ARCH))
        adapters = tmp_path_factory.mktemp("stack-adapters")
        lora_modules = {
            name: str(make_adapter(model, adapters / name, 4, seed, targets=LORA_TARGETS))
            for seed, name in enumerate(LORAS)
        }
        args = {
            "model": model,
            "engine": {**SERVE_ENGINE_ARGS, **LORA_ENGINE_ARGS, "speculative_config": {**SELF_DRAFT, "model": model}},
            "lora_modules": lora_modules,
            "router": {"served_model_name": "tiny"},
            # Autoscaled as deploy/config.gpu.yaml is, pinned at two replicas: Serve exports its
            # autoscaler's series (the dashboard's "Autoscaling" panel) only for such deployments.
            "engine_replica": {
                "autoscaling_config": {"min_replicas": 2, "max_replicas": 2, "initial_replicas": 2},
                "ray_actor_options": {"num_cpus": 1},
            },
        }
        serve.run(build_app(args), name="cb-serve", route_prefix="/")
        prometheus = Prometheus(prometheus_binary, tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{metrics_port}"])
        wait_for("Prometheus to scrape Ray", lambda: prometheus.query('up{job="ray"} == 1'), timeout=60)
        yield f"http://127.0.0.1:{http_port}", prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def openai_client(base_url: str):
    import openai

    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=300, max_retries=0)


async def rejected_requests(base_url: str) -> None:
    """A 404 (unknown model) and a 400 (bad max_tokens)."""
    import openai

    client = openai_client(base_url)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="tiny", prompt="x", max_tokens=-1)


async def workload(base_url: str, n_requests: int, max_tokens: int | None = None) -> tuple[int, int]:
    """``n_requests`` concurrent requests (completions and chat, streaming and not) with a
    shared prefix. Returns (completion tokens the clients were told, requests)."""
    client = openai_client(base_url)

    async def one(i: int) -> int:
        n = max_tokens or 60 + 8 * (i % 6)
        kwargs = dict(model="tiny", max_tokens=n, temperature=0.0, extra_body={"ignore_eos": True})
        prompt = f"{SHARED} Question {i}: what is {i} plus {i}?"
        messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": f"Question {i}?"}]
        if i % 4 == 0:
            return (await client.completions.create(prompt=prompt, **kwargs)).usage.completion_tokens
        if i % 4 == 1:
            return (await client.chat.completions.create(messages=messages, **kwargs)).usage.completion_tokens
        stream_kwargs = dict(stream=True, stream_options={"include_usage": True}, **kwargs)
        if i % 4 == 2:
            stream = await client.completions.create(prompt=prompt, **stream_kwargs)
        else:
            stream = await client.chat.completions.create(messages=messages, **stream_kwargs)
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    tokens = await asyncio.gather(*(one(i) for i in range(n_requests)))
    assert all(t > 0 for t in tokens)
    return sum(tokens), len(tokens)


LORAS = ("a1", "a2")


async def lora_workload(base_url: str) -> tuple[int, int]:
    """Requests for the two adapters in turn, in one session (mostly one replica), so they take its one
    slot from each other. Returns (completion tokens, requests)."""
    client = openai_client(base_url)
    tokens = 0
    for i in range(4):
        out = await client.completions.create(
            model=LORAS[i % 2],
            prompt=f"adapter request {i}",
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": "lora"},
        )
        tokens += out.usage.completion_tokens
    return tokens, 4


async def constrained_workload(base_url: str, tags: list[str]) -> tuple[int, int]:
    """One completion per tag, in turn, each constrained to its own choice (so each compiles a
    grammar), all in one session: they go to one replica, whose structured-output series then
    grow after their first sample (what rate() counts). Returns (completion tokens, requests)."""
    client = openai_client(base_url)
    tokens = 0
    for tag in tags:
        choice = [f"yes {tag}", f"no {tag}"]
        out = await client.completions.create(
            model="tiny",
            prompt=f"{SHARED} Yes or no?",
            max_tokens=16,
            temperature=0.0,
            user="structured-outputs",  # the session
            extra_body={"structured_outputs": {"choice": choice}},
        )
        assert out.choices[0].text in choice and out.choices[0].finish_reason == "stop", out
        tokens += out.usage.completion_tokens
    return tokens, len(tags)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel (rows included)."""

    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in walk(dashboard["panels"]) for t in p.get("targets", [])]


def substitute(expr: str, rate_interval: str, **selected: str) -> str:
    """Grafana's variables, as the dashboard would expand them with "All" selected (the
    variable's allValue, ``.*``) unless ``selected`` names a value; rate windows span
    ``rate_interval`` (the whole workload, so no panel looks at an idle minute)."""
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    values = {
        "__rate_interval": rate_interval,
        "__interval": "15s",
        "__range": rate_interval,
        **{name: v.get("allValue") for name, v in variables.items()},
        **selected,
    }
    expr = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], expr)
    assert "$" not in expr, expr
    return expr


@pytest.mark.timeout(600)
def test_prometheus_sees_the_workload_and_every_dashboard_query_has_data(stack):
    from cb_serve.serve.metrics import ENGINE_METRICS, ROUTER_METRICS, exported_name

    base_url, prom = stack

    def counted(tokens: int, n: int, constrained: int) -> bool:
        return (
            prom.scalar("sum(ray_cb_serve_generation_tokens_total)") == tokens
            and prom.scalar("sum(ray_cb_serve_time_to_first_token_seconds_count)") == n
            and prom.scalar("sum(ray_cb_serve_e2e_request_latency_seconds_count)") == n
            and prom.scalar("sum(ray_cb_serve_router_requests_total)") == n
            and prom.scalar("sum(ray_cb_serve_structured_output_requests_total)") == constrained
        )

    def run_workload(n_requests: int, tags: list[str], max_tokens: int | None = None) -> tuple[int, int]:
        tokens, n = asyncio.run(workload(base_url, n_requests, max_tokens))
        for tag in tags:  # one at a time, each scraped before the next: whichever replica serves them,
            # a structured-output series that already had a sample grows (what rate() counts). The
            # request counter and the compile histogram are exported apart: both are waited for, or
            # two compiles can reach a replica's first export together (a series without an increase).
            before = [prom.scalar(f"sum(ray_cb_serve_{s})") or 0 for s in CONSTRAINED_SERIES]
            more_tokens, more = asyncio.run(constrained_workload(base_url, [tag]))
            tokens, n = tokens + more_tokens, n + more
            wait_for("Prometheus to see a constrained request and its compile", lambda b=before: all(
                prom.scalar(f"sum(ray_cb_serve_{s})") == v + 1 for s, v in zip(CONSTRAINED_SERIES, b)
            ), timeout=90)  # fmt: skip
        return tokens, n

    # Series appear at their first sample and rate() counts only increases after it: a warm-up
    # (and the rejections) first, so the main workload shows up in every rate() of the dashboard.
    started = time.time()
    asyncio.run(rejected_requests(base_url))
    tokens, n = run_workload(4, ["w"], max_tokens=4)
    lora_tokens, lora_n = asyncio.run(lora_workload(base_url))
    tokens, n = tokens + lora_tokens, n + lora_n
    wait_for("Prometheus to see the warm-up", lambda: counted(tokens, n, 1), timeout=90)
    tags = [str(i) for i in range(N_CONSTRAINED)]
    more_tokens, more = run_workload(N_REQUESTS, tags)
    tokens, n, constrained = tokens + more_tokens, n + more, 1 + N_CONSTRAINED
    wait_for("the last scrape to count the whole workload", lambda: counted(tokens, n, constrained), timeout=90)
    # Acceptance 1: exactly what the clients received, and one latency observation per request.
    assert prom.scalar("sum(ray_cb_serve_generation_tokens_total)") == tokens
    assert prom.scalar("sum(ray_cb_serve_time_to_first_token_seconds_count)") == n
    assert prom.scalar("sum(ray_cb_serve_e2e_request_latency_seconds_count)") == n
    assert prom.scalar("sum(ray_cb_serve_request_queue_time_seconds_count)") == n
    assert prom.scalar('sum(ray_cb_serve_request_success_total{finished_reason="length"})') == n - constrained
    assert prom.scalar('sum(ray_cb_serve_request_success_total{finished_reason="stop"})') == constrained  # grammars
    assert prom.scalar("sum(ray_cb_serve_inter_token_latency_seconds_count)") == tokens - n
    kv = prom.query("ray_cb_serve_kv_cache_usage_perc")
    assert len(kv) == 2 and all(0 <= v <= 1 for _, v in kv), kv  # one series per engine replica
    assert all(labels.get("model_name") and labels["model_name"] == labels.get("model") for labels, _ in kv), kv
    assert all(labels.get("replica") for labels, _ in kv), kv
    assert 0 < prom.scalar("max(max_over_time(ray_cb_serve_kv_cache_usage_perc[5m]))") <= 1
    used = prom.query("ray_cb_serve_kv_cache_blocks_used")
    total = prom.query("ray_cb_serve_kv_cache_blocks_total")
    assert len(used) == 2 and {v for _, v in total} == {SERVE_ENGINE_ARGS["num_gpu_blocks"]}
    steps = prom.scalar("sum(ray_cb_serve_batch_token_fill_ratio_count)")
    assert steps and steps == prom.scalar("sum(ray_cb_serve_batch_num_seqs_count)")
    assert prom.scalar('sum(ray_cb_serve_batch_token_fill_ratio_bucket{le="1.0"})') == steps  # every step <= 1
    assert 0 < prom.scalar("sum(ray_cb_serve_batch_token_fill_ratio_sum)") / steps <= 1
    p99 = prom.scalar("histogram_quantile(0.99, sum by (le) (ray_cb_serve_batch_token_fill_ratio_bucket))")
    assert 0 < p99 <= 1
    assert prom.scalar("sum(ray_cb_serve_prefix_cache_hits_total)") > 0
    assert prom.scalar("sum(ray_cb_serve_num_preemptions_total)") > 0
    rejected = {
        labels["status"]: v for labels, v in prom.query("sum by (status) (ray_cb_serve_router_rejections_total)")
    }
    assert rejected == {"404": 1, "400": 1}
    replicas = {labels["replica"] for labels, _ in kv}
    routed = {labels["engine_replica"] for labels, _ in prom.query("ray_cb_serve_router_requests_total")}
    assert routed <= replicas, "the router's engine_replica label must match the engine metrics' replica label"
    # Structured outputs: each constraint is its own, so compiled once wherever it went.
    assert prom.scalar("sum(ray_cb_serve_grammar_compile_seconds_count)") == constrained
    fills = prom.scalar("sum(ray_cb_serve_grammar_bitmask_fill_seconds_count)")
    assert fills and fills == prom.scalar("sum(ray_cb_serve_grammar_bitmask_wait_seconds_count)")
    assert fills < steps  # only steps with constrained sequences
    assert prom.scalar("sum(ray_cb_serve_num_requests_waiting_grammar)") == 0
    # LoRA: the adapters' requests by name, their slot loads and evictions, one slot per replica.
    by_adapter = {
        labels.get("lora_name", ""): v
        for labels, v in prom.query("sum by (lora_name) (ray_cb_serve_request_success_total)")
    }
    assert by_adapter == {"": n - 4, "a1": 2, "a2": 2}, by_adapter
    assert prom.scalar("sum(ray_cb_serve_lora_loads_total)") >= 4
    assert prom.scalar("sum(ray_cb_serve_lora_evictions_total)") >= 1  # most of them on one replica
    assert {v for _, v in prom.query("ray_cb_serve_lora_slots_total")} == {1.0}
    # Mixture of experts: one imbalance observation per step (Ray's histogram sums are its buckets'
    # midpoints: the mean is approximate), every expert had tokens, and every token the target model
    # computed is counted top_k times in each MoE layer: at least every prompt token the prefix cache did
    # not hold and every generated token fed back (all but each request's last). Exact per step:
    # tests/features/test_expert_load.py.
    assert prom.scalar("sum(ray_cb_serve_moe_expert_imbalance_count)") == steps
    assert 1 <= prom.scalar("sum(ray_cb_serve_moe_expert_imbalance_sum)") / steps <= NUM_EXPERTS
    per_expert = prom.query("sum by (expert) (ray_cb_serve_moe_expert_tokens_total)")
    assert {labels["expert"] for labels, _ in per_expert} == {str(e) for e in range(NUM_EXPERTS)}
    routed = sum(v for _, v in per_expert)
    uncached = prom.scalar("sum(ray_cb_serve_prompt_tokens_total)") - prom.scalar(
        "sum(ray_cb_serve_prefix_cache_hits_total)"
    )
    assert routed % (TOP_K * MOE_LAYERS) == 0 and routed / (TOP_K * MOE_LAYERS) >= uncached + tokens - n, per_expert

    for name, (kind, _) in (ENGINE_METRICS | ROUTER_METRICS).items():  # the names Ray really exports
        series = exported_name(name) + ("_count" if kind == "histogram" else "")
        if name in UNFED_METRICS:
            assert not prom.query(series), f"{series} has data now: drop it from UNFED_METRICS"
            continue
        assert prom.query(series), f"no series {series}"
    # Ray Serve's series: both engine replicas healthy, under Serve's replica label (the engine
    # metrics' replica label), the autoscaler's target (min = max = 2), and its queue gauges.
    healthy = prom.query('ray_serve_deployment_replica_healthy{deployment="EngineReplica"}')
    assert {labels["replica"]: v for labels, v in healthy} == dict.fromkeys(replicas, 1.0), healthy
    assert prom.scalar('sum(ray_serve_autoscaling_target_replicas{deployment="EngineReplica"})') == 2
    for series in SERVE_SERIES:
        assert prom.query(f'{series}{{deployment="EngineReplica"}}'), f"no series {series}"

    # Acceptance 2: every query of every panel returns data, evaluated now that every sample is in,
    # over windows covering the workload; only the GPU panels may be empty, and only without a GPU,
    # and those of UNFED_METRICS.
    # Then the cluster filter: a RayCluster that is not there leaves every panel empty.
    allowed_empty = {exported_name(name): why for name, why in UNFED_METRICS.items()}
    if not gpu_present():
        allowed_empty |= dict.fromkeys(GPU_SERIES, "no GPU on this machine")
    at = time.time()
    window = f"{math.ceil(at - started) + 15}s"
    queries = dashboard_queries()
    assert len(queries) >= 40
    missing, empty_as_allowed = {}, {}
    for title, expr in queries:
        result = prom.query(substitute(expr, window), at=at)
        if any(math.isfinite(v) for _, v in result):
            continue
        reasons = {why for series, why in allowed_empty.items() if series in expr}
        if reasons:
            empty_as_allowed[title] = reasons
        else:
            missing[f"{title}: {substitute(expr, window)}"] = result
    assert not missing, f"dashboard queries without data: {missing}"
    may_be_empty = {"GPU utilization", "GPU memory", "Jump-forward tokens", "Triton compiles"}
    images = {"Images: encoder and its cache", "Images: encoder time per step and images per request"}
    assert set(empty_as_allowed) <= may_be_empty | images
    for title, expr in queries:
        assert not prom.query(substitute(expr, window, ray_io_cluster="no-such-cluster"), at=at), title


def gpu_present() -> bool:
    """Whether Ray's node reporter can see a GPU here (it reads NVML, i.e. NVIDIA's driver)."""
    import torch

    return torch.cuda.is_available() or shutil.which("nvidia-smi") is not None


NO_HEALTHY_ENGINE_ALERT = "CBServeNoHealthyEngineReplica"
ENGINE_UNHEALTHY_ALERT = "CBServeEngineReplicaUnhealthy"


def prometheus_rules() -> dict[str, dict[str, Any]]:
    """Every rule of every ``PrometheusRule`` in k8s/*.yaml, by "file: alert (or record)"."""
    yaml = pytest.importorskip("yaml")
    rules = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "PrometheusRule":
                for group in doc["spec"]["groups"]:
                    for rule in group["rules"]:
                        rules[f"{path.name}: {rule.get('alert') or rule['record']}"] = rule
    return rules


@pytest.mark.timeout(300)
def test_every_alert_expression_runs_and_a_healthy_app_raises_no_health_alert(stack):
    """Each ``expr`` of the PrometheusRules in k8s/ evaluated by the real Prometheus scraping the
    app (after the workload above, when run with it): no parse or execution error (an empty
    result is fine). The health alerts stay quiet while both engine replicas are healthy, and the
    no-healthy-replica alert does fire once every replica's health series reads 0."""
    _, prom = stack
    rules = prometheus_rules()
    assert rules, "no PrometheusRule in k8s/*.yaml"
    # Serve's controller reports replica health every 10 s: wait for the engine replicas' first report (the
    # routers' may come first, and the no-healthy-replica alert fires on an absent engine series).
    engine_health = 'ray_serve_deployment_replica_healthy{deployment="EngineReplica"}'
    wait_for("Ray Serve's engine replica health", lambda: prom.query(engine_health), timeout=60)
    results = {name: prom.query(rule["expr"]) for name, rule in rules.items()}  # asserts HTTP 200, "success"
    alerts = {rule.get("alert"): name for name, rule in rules.items()}
    for alert in (NO_HEALTHY_ENGINE_ALERT, ENGINE_UNHEALTHY_ALERT):
        assert alert in alerts, f"no alert {alert} in k8s/*.yaml"
        assert results[alerts[alert]] == [], f"{alert} would fire on a healthy app: {results[alerts[alert]]}"
    expr = rules[alerts[NO_HEALTHY_ENGINE_ALERT]]["expr"]
    all_unhealthy = re.sub(r"ray_serve_deployment_replica_healthy(\{[^}]*\})?", r"(\g<0> * 0)", expr)
    assert all_unhealthy != expr and prom.query(all_unhealthy), f"{NO_HEALTHY_ENGINE_ALERT} cannot fire"
