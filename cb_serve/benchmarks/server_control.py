"""The cb-serve server under test: ``serve run CONFIG`` started and stopped (with every process it
started), readiness, and the torch threads its engine replica gets from the config."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from cb_serve.benchmarks.cpu_accounting import descendants
from cb_serve.benchmarks.report import log

DEFAULT_CONFIG = Path("deploy/config.yaml")  # the repository's, from its root
ENGINE_DEPLOYMENT = "EngineReplica"


def server_root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def server_answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{server_root(base_url)}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until_ready(base_url: str, api_key: str, timeout_s: float, proc: subprocess.Popen | None = None) -> str:
    """Waits for /health and /v1/models; returns the served model's name."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"}
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{server_root(base_url)}/health", timeout=5).status_code == 200:
                models = httpx.get(f"{base_url}/models", headers=headers, timeout=30)
                if models.status_code == 200:
                    return models.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"the server at {base_url} was not ready within {timeout_s:.0f} s")


def launch(config: str, log_path: Path) -> subprocess.Popen:
    """``serve run CONFIG`` in its own process group, output to ``log_path``."""
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log(f"launching `serve run {config}` (log: {log_path})")
    with open(log_path, "w") as out:
        return subprocess.Popen(
            [serve_bin, "run", config], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(proc: subprocess.Popen, wait_for_tree_s: float = 60.0) -> list[int]:
    """Ctrl-C to ``serve run`` (it shuts Serve and its Ray instance down), then harder if it hangs; then
    waits for the processes it had started to be gone. Returns the pids still alive after that."""
    tree = descendants([proc.pid])
    for sig, wait_s in ((signal.SIGINT, 90), (signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            log(f"`serve run` did not stop on {sig.name}")
    deadline = time.monotonic() + wait_for_tree_s
    while True:
        alive = [pid for pid in tree if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(1)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def replica_threads(config_path: Path) -> tuple[int, str]:
    """Torch threads of the cb-serve engine replica that ``config_path`` deploys, and why: the engine's
    ``num_threads``, else the ``OMP_NUM_THREADS`` the replica inherits or Ray sets (floor of its num_cpus,
    at least 1; Serve reserves 1 CPU per replica by default)."""
    try:
        app = yaml.safe_load(config_path.read_text())["applications"][0]
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError) as e:
        return 1, f"{config_path} unreadable ({type(e).__name__}); assumed 1"
    app_args = app.get("args") or {}
    if (app_args.get("engine") or {}).get("num_threads"):
        return int(app_args["engine"]["num_threads"]), f"engine.num_threads in {config_path}"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS of this environment (the replica inherits it)"
    deployments = app.get("deployments") or []
    options = (
        next((d.get("ray_actor_options") for d in deployments if d.get("name") == ENGINE_DEPLOYMENT), None)
        or (app_args.get("engine_replica") or {}).get("ray_actor_options")
        or {}
    )
    num_cpus = options.get("num_cpus", 1)
    reason = f"{ENGINE_DEPLOYMENT} num_cpus {num_cpus} in {config_path} (Ray's OMP_NUM_THREADS)"
    return max(math.floor(num_cpus), 1), reason
