"""SIGTERM to the README's server (``cb-serve serve deploy/config.yaml``, which runs ``serve run``)
with a stream in flight (reliability issue, item 6): the stream finishes normally within
``graceful_shutdown_timeout_s`` and ends with [DONE], then the server exits. (``serve run``
alone exits at once on SIGTERM, cutting every stream.) The server is started with SIGINT
ignored, as a shell script's ``&``, ``nohup`` or some supervisors start it (``serve run`` would
inherit that and never stop on the SIGINT it is sent). Loopback only; every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serving import SSEStream, kill_session, sessions_of, wait_for

pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parents[2]
BASE = "http://127.0.0.1:8000"  # deploy/config.yaml's port
BIN = Path(sys.executable).parent


@pytest.mark.timeout(600)
def test_sigterm_lets_streams_in_flight_finish_then_exits(tmp_path):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "CB_SERVE_API_KEY": ""}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [str(BIN / "cb-serve"), "serve", "deploy/config.yaml"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as under `&` in a script
    )
    sessions = {proc.pid}
    try:
        wait_for("the server", lambda: httpx.get(f"{BASE}/v1/models", timeout=5).status_code == 200, 300, 2)
        sessions |= sessions_of(proc.pid)  # its `serve run`'s, while it runs

        async def scenario() -> tuple[SSEStream, float]:
            async with httpx.AsyncClient(base_url=BASE, timeout=120) as client:
                stream = SSEStream()
                body = {"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True}
                task = asyncio.create_task(stream.run(client, "/v1/completions", body))
                await asyncio.wait_for(stream.first_chunk.wait(), 60)
                proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                await asyncio.wait_for(task, 120)
                return stream, sent

        stream, sent = asyncio.run(scenario())
        code = proc.wait(timeout=120)
        exited_s = time.monotonic() - sent
        print(
            f"\nSIGTERM: the stream in flight ended {stream.ended_at - sent:.1f} s later ({stream.chunks} chunks, "
            f"{stream.finish_reasons}, [DONE] {stream.done}); the server exited {exited_s:.1f} s later, code {code}"
        )
        assert stream.done and stream.error is None and not stream.cut, stream
        assert stream.finish_reasons == ["length"] and stream.chunks == 200
        assert code == 0
    finally:
        for sid in sessions:  # cb-serve's, its `serve run`'s and that one's Ray instance's
            kill_session(sid)
        log.close()
