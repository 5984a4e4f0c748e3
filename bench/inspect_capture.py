"""Captures the batch inspector during a serving benchmark (``serve_bench.py --trace-out /
--screenshot``): the Chrome trace of the last seconds, and a headless-Chromium screenshot of the
live ``/inspect`` page."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path


def fetch_trace(root: str, api_key: str, seconds: float, out: Path) -> int:
    """Writes ``/debug/trace?seconds=`` to ``out``; returns its size in bytes."""
    headers = {"Authorization": f"Bearer {api_key}"}
    req = urllib.request.Request(f"{root}/debug/trace?seconds={seconds:g}", headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        trace = json.load(r)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace, separators=(",", ":")))
    return out.stat().st_size


def screenshot(root: str, out: Path, wait_ms: int = 5000) -> bool:
    """Headless Chromium's screenshot of ``/inspect`` after ``wait_ms`` of live updates."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--window-size=1400,1000", f"--timeout={wait_ms}", f"--screenshot={out}", f"{root}/inspect"]  # fmt: skip
    subprocess.run(cmd, capture_output=True, timeout=120)
    return out.exists()


def screenshot_later(root: str, out: Path, after_s: float) -> threading.Thread:
    """Takes the screenshot ``after_s`` seconds from now, in a thread (join it before stopping the server)."""
    thread = threading.Thread(target=lambda: (time.sleep(after_s), screenshot(root, out)), daemon=True)
    thread.start()
    return thread
