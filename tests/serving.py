"""Helpers for tests that run the Serve application for real: a local Ray instance with
Serve's HTTP proxy on a loopback port, deploying ``build_app`` and waiting for it, finding
engine replica processes through Ray's state API, and reading SSE streams with their ends."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPLICA_HEADER = "x-cb-replica"
NEXT_TEST: dict[str, str | None] = {"module": None}  # the file of the next test to run here (tests/conftest.py)
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid`` (by ``/proc``'s parent links)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def sessions_of(pid: int) -> set[int]:
    """The sessions of ``pid``'s live descendants (``cb-serve serve`` starts ``serve run`` in a session of its
    own), the tests' own aside."""
    sessions = set()
    for p in descendants(pid):
        try:
            sessions.add(os.getsid(p))
        except OSError:
            pass
    return sessions - {os.getsid(0)}


def kill_session(sid: int, timeout: float = 30) -> None:
    """SIGKILL to every process of session ``sid`` (a process started with ``start_new_session``: its
    Ray cluster's GCS, raylet, workers and reaper keep the session, whatever process group they take),
    until none is left. Unlike ``ray stop --force`` it leaves the other Ray clusters on this machine
    alone: the Serve modules run in two groups at once (``conftest.pytest_xdist_make_scheduler``)."""
    deadline = time.monotonic() + timeout
    while pids := session_pids(sid):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert time.monotonic() < deadline, f"session {sid} still has processes {pids}"
        time.sleep(0.2)


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (field 6 of ``/proc/PID/stat``), zombies aside."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, _pgrp, session = stat.read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session) == sid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    """Polls ``check()`` until it returns a truthy value (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as e:  # noqa: BLE001 - keep polling; report the last failure
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


@contextmanager
def serve_run(
    config: Path, workdir: Path, env: dict[str, str], headers: dict[str, str] | None = None, timeout_s: float = 240
) -> Iterator[str]:
    """``serve run CONFIG`` as a user runs it (a process group of its own, from the repository root),
    until ``/v1/models`` answers on 127.0.0.1:8000; stopped with Ctrl-C, then every process of its
    session killed. Yields the base URL; the log is ``workdir/serve_run.log``."""
    bin_dir = Path(sys.executable).parent
    serve_bin = shutil.which("serve", path=str(bin_dir)) or "serve"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", **env}
    log_path = workdir / "serve_run.log"
    log = log_path.open("w")
    root = Path(__file__).resolve().parents[1]
    command, output = [serve_bin, "run", str(config)], dict(stdout=log, stderr=subprocess.STDOUT)
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731 - xdist workers ignore it
    proc = subprocess.Popen(  # (inheriting that, `serve run` would never stop on the SIGINT below: 60 s lost)
        command, cwd=root, env=env, **output, start_new_session=True, preexec_fn=default_sigint
    )

    def log_tail() -> str:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])

    base = "http://127.0.0.1:8000"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"serve run exited; its log ends:\n{log_tail()}"
            try:
                if httpx.get(f"{base}/v1/models", headers=headers, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail(f"the server did not come up within {timeout_s} s; its log ends:\n{log_tail()}")
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        kill_session(proc.pid)
        log.close()


# ``serve run deploy/config.yaml`` as a user runs it, with the config's speculation line switched on, an API key,
# and a second application (``/thinker``: a tiny scripted model whose Qwen3-like template thinks in ``<think>``,
# served with ``reasoning_parser: qwen3``): one server for the modules that call it, run one after another
# (``conftest.shared_cluster_rank``), kept from one to the next (starting one costs ~30 CPU-seconds).
API_KEY = "test-key-123"  # every /v1 call needs it
AUTH = {"authorization": f"Bearer {API_KEY}"}
SMOL_SERVER_MODULES = ("test_clients.py", "test_serve.py")
THINKER_APP = """
  - name: thinker
    route_prefix: /thinker
    import_path: cb_serve.serve.app:build_app
    args:
      model: {model}
      engine: {{max_model_len: 512, num_gpu_blocks: 64, max_num_seqs: 8, reasoning_parser: qwen3}}
      router: {{served_model_name: thinker}}
    deployments:
      - name: EngineReplica
        ray_actor_options: {{num_cpus: 0}}
      - name: Router
        ray_actor_options: {{num_cpus: 0}}
"""
_smol_server: dict[str, Any] = {}  # the running one: its base URL and what stops it


@contextmanager
def smol_server(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Iterator[str]:
    """The shared server above (started where none runs); stopped afterwards unless the next test's module
    is one of ``SMOL_SERVER_MODULES``. Yields its base URL."""
    from scripted_model import make_scripted_model

    keep = False
    try:
        if not _smol_server:
            root = Path(__file__).resolve().parents[1]
            workdir = tmp_path_factory.mktemp("smol-server")
            make_scripted_model(workdir / "thinker", tokenizer)
            text = (root / "deploy" / "config.yaml").read_text()
            assert "        # speculative_config:" in text
            text = text.replace("        # speculative_config:", "        speculative_config:")
            config = workdir / "config.yaml"
            config.write_text(text + THINKER_APP.format(model=workdir / "thinker"))
            _smol_server["stack"] = stack = ExitStack()
            _smol_server["base"] = stack.enter_context(
                serve_run(config, workdir, {"CB_SERVE_API_KEY": API_KEY}, headers=AUTH)
            )
            httpx.get(f"{_smol_server['base']}/thinker/v1/models", headers=AUTH, timeout=60).raise_for_status()
        yield _smol_server["base"]
        keep = NEXT_TEST["module"] in SMOL_SERVER_MODULES
    finally:
        if not keep and _smol_server:
            _smol_server.pop("stack").close()
            _smol_server.clear()


# The Serve modules that run in this process's test worker one after another (``conftest.SERVE_RUN_GROUP``'s
# other group) share one Ray cluster, started by the first and stopped after the last: starting and stopping one
# costs ~10 s. Each module keeps its own app (``run_app`` replaces the others; the rest are deleted when it ends).
SHARED_PORT = 8321
SHARED_CLUSTER_MODULES = (
    "test_agent_loops.py",
    "test_inspect_serve.py",
    "test_kv_routing.py",
    "test_lora_serve.py",
    "test_serve_replicas.py",
    "test_tensor_parallel_serve.py",
    "test_vision_serve.py",
)
_cluster: dict[str, int] = {}  # the running cluster's port and CPUs


@contextmanager
def local_ray_serve(port: int, num_cpus: int = 4) -> Iterator[Any]:
    """A local Ray instance with Serve's HTTP proxy on 127.0.0.1:``port``: this process's running one where it
    has that port and ``num_cpus``, a fresh one otherwise. Afterwards it is kept, without its apps, where the
    next test's module is one of ``SHARED_CLUSTER_MODULES`` (on ``SHARED_PORT``), and shut down otherwise."""
    import ray
    from ray import serve

    if _cluster and (_cluster != {"port": port, "num_cpus": num_cpus} or not ray.is_initialized()):
        _stop_cluster()
    if not _cluster:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": RAY_ENV},
        )
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        except BaseException:  # never kept without Serve: the next module would find no proxy
            ray.shutdown()
            raise
        _cluster.update(port=port, num_cpus=num_cpus)
    try:
        yield serve
    finally:
        if port == SHARED_PORT and NEXT_TEST["module"] in SHARED_CLUSTER_MODULES:
            for app in list(serve.status().applications):
                serve.delete(app)
        else:
            _stop_cluster()


def _stop_cluster() -> None:
    import ray
    from ray import serve

    _cluster.clear()
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def run_app(
    args: dict[str, Any], name: str, model_name: str = "tiny", timeout_s: float = 300, keep_engine: bool = False
) -> None:
    """Deploys ``build_app(args)`` at ``/`` (replacing any other app) as ``model_name``; waits until RUNNING.

    ``keep_engine``: the ``EngineReplica`` deployment gets a ``version`` that digests its bound arguments
    (model, engine arguments, adapters). Ray Serve restarts a deployment's replicas on a redeploy when its
    version (random where none is given) or actor options change, so a redeploy that changes only the
    Router's settings (the API key, the inspector switch) keeps the running engine replicas instead of
    loading the model again; any other engine change still gets new ones. (Ray 2.60 took ``version`` out of
    the public ``Deployment.options``; ``serve.run`` still deploys a deployment's ``_version`` when set,
    and a random one otherwise: ``ray/serve/_private/client.py``, ``_private/version.py``.)"""
    from ray import serve

    from cb_serve.serve.app import build_app

    for other in list(serve.status().applications):
        if other != name:
            serve.delete(other)
    router = {**args.get("router", {}), "served_model_name": model_name}
    app = build_app({**args, "router": router})
    if keep_engine:
        engine = app._bound_deployment.init_args[0]  # the EngineReplica application the Router is bound to
        bound = json.dumps(engine._bound_deployment.init_args, sort_keys=True, default=str)
        version = hashlib.sha256(bound.encode()).hexdigest()[:16]
        engine._bound_deployment = engine._bound_deployment.options(version=version, _internal=True)
    serve.run(app, name=name, route_prefix="/", blocking=False)
    deadline = time.monotonic() + timeout_s
    while (status := serve.status().applications[name]).status != "RUNNING":
        assert time.monotonic() < deadline, f"{name} did not start: {status}"
        assert status.status not in ("DEPLOY_FAILED", "UNHEALTHY"), status
        time.sleep(0.5)


def running_engine_replicas(app: str) -> int:
    from ray import serve

    return serve.status().applications[app].deployments["EngineReplica"].replica_states.get("RUNNING", 0)


def engine_replica_pids(app: str) -> dict[str, int]:
    """Replica id (as in the ``x-cb-replica`` header) -> pid of its worker process, for the live
    EngineReplica actors of ``app`` (Ray's actor table in the GCS: no dashboard needed)."""
    from ray._private.state import actors

    return {
        a["Name"].rsplit("#", 1)[-1]: a["Pid"]
        for a in actors().values()
        if a["ActorClassName"] == f"ServeReplica:{app}:EngineReplica" and a["State"] == "ALIVE"
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class SSEStream:
    """One streaming request read to its end: what came, how it ended, and when."""

    status: int = 0
    replica: str = ""
    chunks: int = 0
    error: dict[str, Any] | None = None  # an in-band error event
    done: bool = False  # [DONE] arrived
    cut: str = ""  # the connection broke without [DONE]
    finish_reasons: list[str] = field(default_factory=list)
    ended_at: float = 0.0  # time.monotonic()
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, client: httpx.AsyncClient, url: str, body: dict[str, Any], stop_after: int = 0) -> SSEStream:
        """Streams ``body``; ``stop_after``: disconnect after that many chunks (0: read to the end)."""
        try:
            async with client.stream("POST", url, json={**body, "stream": True}) as r:
                self.status, self.replica = r.status_code, r.headers.get(REPLICA_HEADER, "")
                if r.status_code != 200:
                    self.error = (json.loads(await r.aread()) or {}).get("error")
                    return self
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    self.chunks += 1
                    self.first_chunk.set()
                    self.finish_reasons += [c["finish_reason"] for c in event["choices"] if c.get("finish_reason")]
                    if stop_after and self.chunks >= stop_after:
                        break
        except httpx.HTTPError as e:
            self.cut = f"{type(e).__name__}: {e}"
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()
        return self
