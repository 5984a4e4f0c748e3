"""Node loss (reliability issue, 8.2): a two-node Ray cluster on this machine (``ray start
--head`` and a second ``ray start --address=...`` node with its own resources), one engine
replica on each node, Serve's proxy and the Router on the head. The second node is killed
(its ``ray start --block`` process, raylet and workers: SIGKILL) while requests flow: the
service keeps answering from the head node; when a node comes back, the application returns
to two replicas. Loopback only; every wait is bounded; the figures are printed (``pytest -s``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from models import make_random_model
from serving import RAY_ENV, descendants, free_port, kill_session, run_app, running_engine_replicas, wait_for

serve = pytest.importorskip("ray.serve")

RAY = str(Path(sys.executable).parent / "ray")
PORT = 8325
BASE = f"http://127.0.0.1:{PORT}"
APP = "nodes"
# Two loopback addresses Ray does not rewrite to the machine's address (it does so for 127.0.0.1).
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
# The GCS declares a node dead after 3 missed health checks 1 s apart (defaults: 5 x 3 s).
SESSIONS: list[int] = []  # each worker node's session (its `ray start` process id)
ENV = {**os.environ, **RAY_ENV, "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


class WorkerNode:
    """``ray start --address=HEAD --block`` with one ``engine_slot``: a second node on this machine."""

    def __init__(self, address: str, log: Path) -> None:
        self.log = log.open("a")
        self.proc = subprocess.Popen(
            [
                RAY,
                "start",
                f"--address={address}",
                f"--node-ip-address={WORKER_IP}",
                "--num-cpus=2",
                '--resources={"engine_slot": 1}',
                "--block",
            ],
            env=ENV,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        SESSIONS.append(self.proc.pid)

    def kill(self) -> None:
        """Node loss: the node's every process at once."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def rejoin(cluster: dict[str, Any], timeout: float) -> None:
    """The lost node started again, as its supervisor would (KubeRay recreates the pod), until two nodes are
    alive: a start that gives up joining (Ray's "node timed out during startup", when the head's GCS is slow on
    a loaded machine) is started again, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        worker = cluster["worker"] = WorkerNode(cluster["address"], cluster["tmp"] / "worker.log")
        left = deadline - time.monotonic()
        wait_for("the node to join or give up", lambda w=worker: alive_nodes() == 2 or w.proc.poll() is not None, left)
        if alive_nodes() == 2:
            return
        worker.kill()  # what the failed start left


def forget_ray_address(address: str) -> None:
    """Removes Ray's record of the last `ray start` cluster (``ray_current_cluster`` in its temp dir) where it
    is ``address``: `ray.init()` without an address, as `serve run` calls it, joins the cluster recorded."""
    record = Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray" / "ray_current_cluster"
    try:
        if record.read_text().strip() == address:
            record.unlink()
    except FileNotFoundError:
        pass


def alive_nodes() -> int:
    import ray

    return sum(n["Alive"] for n in ray.nodes())


def replica_nodes() -> dict[str, str]:
    """Engine replica id -> node id, for the live replicas."""
    from ray._private.state import actors

    return {
        a["Name"].rsplit("#", 1)[-1]: a["Address"]["NodeID"]
        for a in actors().values()
        if a["ActorClassName"] == f"ServeReplica:{APP}:EngineReplica" and a["State"] == "ALIVE"
    }


def start_head(attempts: int = 2) -> tuple[subprocess.Popen, str]:
    """``ray start --head`` in a session of its own (its daemons are killed by session, not by ``ray stop``:
    every cluster here), and its address. Started again, on another port, when its raylet missed Ray's
    hard-coded 30 s to register with the GCS (a CI machine saturated by the other tests can)."""
    for attempt in range(attempts):
        port = free_port()
        head = [
            RAY,
            "start",
            "--head",
            f"--node-ip-address={HEAD_IP}",
            f"--port={port}",
            "--num-cpus=2",
            '--resources={"engine_slot": 1, "head_node": 1}',
            "--include-dashboard=false",
            "--disable-usage-stats",
        ]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        started = subprocess.Popen(head, env=ENV, start_new_session=True, **pipes)
        out = started.communicate(timeout=180)[0].decode(errors="replace")
        if started.returncode == 0:
            return started, f"{HEAD_IP}:{port}"
        kill_session(started.pid)
        forget_ray_address(f"{HEAD_IP}:{port}")
        assert attempt + 1 < attempts and "timed out during startup" in out, out
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tokenizer):
    import ray

    tmp = tmp_path_factory.mktemp("nodes")
    model_dir = make_random_model(tmp / "model", "llama", tokenizer)
    started, address = start_head()
    state = {"address": address, "model": model_dir, "worker": None, "tmp": tmp}
    try:
        state["worker"] = WorkerNode(address, tmp / "worker.log")
        ray.init(address=address, _node_ip_address=HEAD_IP, log_to_driver=False, runtime_env={"env_vars": RAY_ENV})
        wait_for("two alive Ray nodes", lambda: alive_nodes() == 2, 120)
        serve.start(http_options={"host": "127.0.0.1", "port": PORT}, proxy_location="HeadOnly")
        yield state
    finally:
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001 - the cluster is torn down next anyway
            pass
        ray.shutdown()
        for sid in [*SESSIONS, started.pid]:  # every node's processes, the reparented ones too
            kill_session(sid)
        forget_ray_address(address)  # what `ray stop` also does: a later `serve run` must not join it


class Load:
    """Short requests every 0.2 s from a thread: (time sent, status, engine replica)."""

    def __init__(self) -> None:
        self.results: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=BASE, timeout=30) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    r = client.post("/v1/completions", json={"prompt": f"node {len(self.results)}", "max_tokens": 2})
                    self.results.append((sent, r.status_code, r.headers.get("x-cb-replica", "")))
                except httpx.HTTPError:
                    self.results.append((sent, 0, ""))
                self._stop.wait(0.2)

    def stop(self) -> list[tuple[float, int, str]]:
        self._stop.set()
        self._thread.join(timeout=60)
        return self.results


@pytest.mark.timeout(600)
def test_losing_a_node_keeps_the_service_up_and_its_replica_comes_back(cluster):
    args: dict[str, Any] = {
        "model": str(cluster["model"]),
        "engine": {"max_model_len": 256, "num_gpu_blocks": 128, "num_threads": 1},
        "routing_stats_period_s": 0.2,
        "engine_replica": {
            "num_replicas": 2,
            "health_check_period_s": 1,
            "graceful_shutdown_timeout_s": 2,
            "ray_actor_options": {"num_cpus": 1, "resources": {"engine_slot": 1}},
        },
        "router_replica": {"ray_actor_options": {"num_cpus": 0, "resources": {"head_node": 0.01}}},
    }
    run_app(args, APP)
    nodes = wait_for("one engine replica per node", lambda: len(set((n := replica_nodes()).values())) == 2 and n, 60)
    load = Load()
    time.sleep(3)
    killed_at = time.monotonic()
    cluster["worker"].kill()
    time.sleep(20)
    during = load.stop()
    after_kill = [r for r in during if r[0] >= killed_at]
    failed = [r for r in after_kill if r[1] != 200]
    last_failure_s = max((r[0] - killed_at for r in failed), default=0.0)
    late = [r for r in after_kill if r[0] - killed_at > 12]

    restarted_at = time.monotonic()
    rejoin(cluster, 120)
    wait_for("two running engine replicas again", lambda: running_engine_replicas(APP) == 2, 240)
    back = wait_for(
        "requests on two replicas again",
        lambda: (
            len(
                {
                    httpx.post(f"{BASE}/v1/completions", json={"prompt": "back", "max_tokens": 2}, timeout=30).headers[
                        "x-cb-replica"
                    ]
                    for _ in range(12)
                }
            )
            == 2
        ),
        120,
        interval=1,
    )
    back_s = time.monotonic() - restarted_at
    print(
        f"\nnode loss: {len(after_kill)} requests in the 20 s after the kill, {len(failed)} failed "
        f"{sorted({r[1] for r in failed})}, the last {last_failure_s:.1f} s after it; "
        f"{len(late)} sent 12-20 s after it, all from the head replica: {len({r[2] for r in late}) == 1}; "
        f"two replicas again {back_s:.1f} s after the node came back"
    )
    assert len(set(nodes.values())) == 2
    assert late and all(r[1] == 200 for r in late), "the service keeps answering from the head node"
    assert sum(r[1] == 200 for r in after_kill) >= len(after_kill) - 5, failed
    assert all(r[1] in (200, 503) for r in after_kill), "a failure is a clean, retryable 503"
    assert back
