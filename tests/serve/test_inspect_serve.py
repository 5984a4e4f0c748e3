"""The batch inspector over real Ray Serve and real HTTP (issue 15): ``return_timeline`` for a
chunked and preempted request, timelines by id, the merged Chrome trace, the live ``/inspect``
page in a real headless Chromium under load (and its expert heat map for a mixture of experts, issue
39), the API key and the off switch.

The engine is a tiny random-weight Llama with a 64-token budget (prompts are chunked) and 48 KV
blocks for several 300-token sequences at once (decodes preempt). The API key's and the off switch's
tests redeploy the Router only (``run_app(keep_engine=True)``: the engine replicas stay); the heat
map's test, last, redeploys the app on a tiny random Qwen3-MoE in the same cluster."""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from browser import open_page
from models import make_random_model
from serving import REPLICA_HEADER, SHARED_PORT, local_ray_serve, run_app, wait_for
from trace_format import validate_trace

serve = pytest.importorskip("ray.serve")

PORT = SHARED_PORT  # one Ray cluster for these modules (serving.SHARED_CLUSTER_MODULES)
BASE = f"http://127.0.0.1:{PORT}"
APP = "inspect"
ENGINE = {
    "max_model_len": 512,
    "num_gpu_blocks": 48,
    "block_size": 16,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 64,
    "num_threads": 1,
}
ARGS = {"engine": ENGINE, "engine_replica": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}}}
SCREENSHOT = Path(os.environ.get("CB_SERVE_INSPECT_SCREENSHOT", "/tmp/cb-serve-inspect.png"))
MOE_SCREENSHOT = Path(os.environ.get("CB_SERVE_INSPECT_MOE_SCREENSHOT", "/tmp/cb-serve-inspect-moe.png"))
MOE_ROWS = ["0", "2"]  # tests/models.py's qwen3_moe: layers 0 and 2 sparse (8 experts, top 2), layer 1 dense
MOE_CELL = re.compile(r'<rect class="moe-cell"[^>]* data-expert="(\d+)" data-tokens="(\d+)"')


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return make_random_model(tmp_path_factory.mktemp("llama-inspect"), "llama", tokenizer)


@pytest.fixture(scope="module")
def app(model_dir):
    with local_ray_serve(PORT):
        run_app({"model": str(model_dir), **ARGS}, APP, keep_engine=True)
        yield str(model_dir)


def prompt(i: int) -> str:
    return f"Request {i} {uuid.uuid4().hex}: " + "tell me more about continuous batching " * 22


def complete(client: httpx.Client, i: int, max_tokens: int = 96, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return client.post(f"{BASE}/v1/completions", json={**body, **extra}, timeout=180)


def burst(n: int, **extra) -> list[httpx.Response]:
    """``n`` concurrent completions: more KV than the cache holds, so some are preempted."""
    out: list[httpx.Response] = [None] * n  # type: ignore[list-item]

    def send(i: int) -> None:
        with httpx.Client() as c:
            out[i] = complete(c, i, **extra)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.timeout(600)
def test_return_timeline_of_chunked_and_preempted_requests(app):
    responses = burst(10, return_timeline=True)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    found = 0
    for r in responses:
        body = r.json()
        tl = body["timeline"]
        assert tl["request_id"] == body["id"] and tl["replica"] == r.headers[REPLICA_HEADER]
        kinds = [e["event"] for e in tl["events"]]
        prefills = [e for e in tl["events"] if e["event"] == "prefill"]
        assert kinds[0] == "scheduled" and kinds[-1] == "finished" and tl["finish_reasons"] == {"0": "length"}
        assert kinds.count("first_token") == 1 and tl["decode"]["0"]["steps"] >= 1
        assert tl["arrival"] <= tl["first_token"] <= tl["finished"]
        if "preempted" not in kinds or max(e["chunk"] for e in prefills) < 2:
            continue
        found += 1
        # Chunks of the first pass cover the prompt after the prefix hit; each preemption is
        # followed by a re-admission and a recomputation whose chunks restart at 1.
        restart = next((i for i, e in enumerate(prefills[1:], 1) if e["chunk"] == 1), len(prefills))
        if kinds.index("preempted") > kinds.index("first_token"):
            first_pass = sum(e["tokens"] for e in prefills[:restart])
            assert first_pass + tl["events"][0]["cached_tokens"] == body["usage"]["prompt_tokens"]
        assert kinds.count("preempted") == kinds.count("readmitted")
        # Step ids name the replica's step records, which agree.
        steps = httpx.get(
            f"{BASE}/debug/state", params={"replica": tl["replica"], "limit": 2000, "after_step": -1}, timeout=30
        ).json()["steps"]
        by_step = {s["step"]: s for s in steps}
        for e in prefills:
            seq = next(x for x in by_step[e["step"]]["seqs"] if x["request_id"] == body["id"])
            assert (seq["tokens"], seq["chunk"], seq["kind"]) == (e["tokens"], e["chunk"], "prefill")
        for e in tl["events"]:
            if e["event"] == "preempted":
                assert [body["id"], 0] in by_step[e["step"]]["preempted"]
        assert httpx.get(f"{BASE}/v1/requests/{body['id']}/timeline", timeout=30).json() == tl
    assert found, "no request was both chunked and preempted: the workload is too light"


@pytest.mark.timeout(300)
def test_streamed_timeline_is_in_the_final_chunk(app):
    body = {"model": "tiny", "prompt": prompt(0), "max_tokens": 5, "stream": True, "return_timeline": True}
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_timeline = [c for c in chunks if "timeline" in c]
    assert len(with_timeline) == 1 and with_timeline[0] is chunks[-1] and chunks[-1]["choices"][0]["finish_reason"]
    assert with_timeline[0]["timeline"]["request_id"] == chunks[0]["id"]
    plain = httpx.post(f"{BASE}/v1/completions", json={**body, "stream": False, "return_timeline": False}, timeout=60)
    assert "timeline" not in plain.json()
    missing = httpx.get(f"{BASE}/v1/requests/cmpl-nope/timeline", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


@pytest.mark.timeout(300)
def test_trace_of_every_replica_is_valid(app, tmp_path):
    burst(4, max_tokens=16)
    trace = httpx.get(f"{BASE}/debug/trace", params={"seconds": 60}, timeout=60).json()
    assert len(trace["otherData"]["replicas"]) == 2 and not trace["otherData"]["missing"]
    validate_trace(trace["traceEvents"])
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {f"replica {r}" for r in trace["otherData"]["replicas"]}
    one = httpx.get(f"{BASE}/debug/trace", params={"seconds": 60, "replica": trace["otherData"]["replicas"][0]}).json()
    validate_trace(one["traceEvents"])
    assert {e["pid"] for e in one["traceEvents"]} == {1}
    # Validation errors are 400s (OpenAI style).
    assert httpx.get(f"{BASE}/debug/trace", params={"seconds": 0}).status_code == 400
    assert httpx.get(f"{BASE}/debug/trace", params={"replica": "nope"}).status_code == 404


@pytest.mark.timeout(600)
def under_load(n: int) -> tuple[threading.Event, list[threading.Thread]]:
    """``n`` clients sending completions one after another until the event is set."""
    stop = threading.Event()

    def load() -> None:
        with httpx.Client() as c:
            i = 0
            while not stop.is_set():
                complete(c, i, max_tokens=48)
                i += 1

    workers = [threading.Thread(target=load) for _ in range(n)]
    for w in workers:
        w.start()
    return stop, workers


def test_inspect_page_renders_live_in_headless_chromium(app):
    stop, workers = under_load(4)
    try:
        wait_for("steps under load", lambda: httpx.get(f"{BASE}/debug/state", timeout=30).json()["num_running"] > 0, 60)
        with open_page(f"{BASE}/inspect") as page:
            ready = "document.querySelectorAll('g.step').length >= 10 && !!document.querySelector('.kv-cell.used')"
            wait_for("the page to draw steps and used blocks", lambda: page.evaluate(ready), 60)
            doms = [page.dom()]
            newest = "document.querySelector('g.step:last-of-type').dataset.step"
            first = page.evaluate(newest)
            wait_for("new steps and used blocks", lambda: page.evaluate(newest) != first and page.evaluate(ready), 60)
            doms.append(page.dom())
            page.screenshot(SCREENSHOT)
    finally:
        stop.set()
        for w in workers:
            w.join()
    snapshots = []
    for dom in doms:
        steps = re.findall(r'<g class="step" data-step="(\d+)"', dom)
        segments = re.findall(r'<g class="seg (prefill|decode)" data-request="([^"]+)"', dom)
        cells = re.findall(r'<div class="kv-cell ([a-z ]+)"', dom)
        assert len(steps) >= 10, f"too few step columns rendered: {len(steps)}\n{dom[:2000]}"
        assert {k for k, _ in segments} == {"prefill", "decode"}, "both prefill and decode segments"
        assert len(cells) == ENGINE["num_gpu_blocks"] and any(c.startswith("used") for c in cells)
        assert re.search(r'<table id="running">.*?<td class="rid"', dom, re.S), "the running queue lists requests"
        assert '<section id="experts">' in dom and not MOE_CELL.search(dom), "a dense model has no expert heat map"
        snapshots.append((steps, segments, cells))
    assert snapshots[0][0] != snapshots[1][0], "the step columns must advance between two snapshots"
    assert SCREENSHOT.stat().st_size > 10_000


AUTH_ROUTES = [
    "/inspect",
    "/debug/replicas",
    "/debug/state",
    "/debug/events",
    "/debug/trace",
    "/v1/requests/x/timeline",
]


@pytest.mark.timeout(600)
def test_every_debug_endpoint_needs_the_api_key(app):
    run_app({"model": app, **ARGS, "router": {"api_key": "sekrit"}}, APP, keep_engine=True)  # the engines stay
    for path in AUTH_ROUTES:
        r = httpx.get(f"{BASE}{path}", timeout=30)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error" and "Basic" in r.headers["www-authenticate"]
        assert httpx.get(f"{BASE}{path}", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    ok = {"Authorization": "Bearer sekrit"}
    assert httpx.get(f"{BASE}/debug/replicas", headers=ok, timeout=30).status_code == 200
    basic = {"Authorization": "Basic " + base64.b64encode(b"anyone:sekrit").decode()}  # what a browser sends
    assert httpx.get(f"{BASE}/inspect", headers=basic, timeout=30).status_code == 200


@pytest.mark.timeout(600)
def test_the_inspector_can_be_turned_off(app):
    run_app({"model": app, **ARGS, "router": {"inspector": False}}, APP, keep_engine=True)
    for path in AUTH_ROUTES:
        assert httpx.get(f"{BASE}{path}", timeout=30).status_code == 404, path
    r = httpx.post(f"{BASE}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


@pytest.mark.timeout(600)
def test_inspect_page_shows_the_expert_heat_map_of_a_mixture_of_experts(app, random_model_dir):
    """The app redeployed on a tiny Qwen3-MoE (one engine replica) in the same cluster: under load, the
    page draws a layer x expert heat map of the last steps; every row counts the same tokens (each
    token goes to top_k experts of every MoE layer); once idle it shows the replica's own counts."""
    engine_replica = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1}}
    run_app({"model": str(random_model_dir("qwen3_moe")), **ARGS, "engine_replica": engine_replica}, APP)
    stop, workers = under_load(3)
    try:
        wait_for("steps under load", lambda: httpx.get(f"{BASE}/debug/state", timeout=30).json()["num_running"] > 0, 60)
        with open_page(f"{BASE}/inspect") as page:
            heat_map = "document.querySelectorAll('#experts.open rect.moe-cell').length === 16"
            ready = f"{heat_map} && document.querySelectorAll('g.step').length >= 30"
            wait_for("the page to draw the heat map", lambda: page.evaluate(ready), 60)
            page.screenshot(MOE_SCREENSHOT)
            window = lambda: httpx.get(f"{BASE}/debug/state", timeout=30).json()["experts"]["steps"] == 60  # noqa: E731
            wait_for("a full window of 60 steps (a slow machine may not have run them yet)", window, 120)
            stop.set()
            for w in workers:
                w.join()
            state = httpx.get(f"{BASE}/debug/state", timeout=30).json()["experts"]
            summary = "document.getElementById('moe-summary').textContent"
            wait_for("the page's last snapshot", lambda: f"–{state['last_step']})" in page.evaluate(summary), 30)
            dom = page.dom()
    finally:
        stop.set()
        for w in workers:
            w.join()
    rows = re.findall(r'<g class="moe-layer" data-layer="(\d+)">(.*?)</g>', dom, re.S)
    assert [layer for layer, _ in rows] == MOE_ROWS and state["layers"] == [0, 2] and state["steps"] == 60
    tokens = [[int(n) for _, n in MOE_CELL.findall(cells)] for _, cells in rows]
    assert tokens == state["tokens"] and all(len(row) == 8 for row in tokens)
    assert len({sum(row) for row in tokens}) == 1 and sum(tokens[0]) >= 2 * 60, "each step's tokens, top 2 per layer"
    assert MOE_SCREENSHOT.stat().st_size > 10_000
