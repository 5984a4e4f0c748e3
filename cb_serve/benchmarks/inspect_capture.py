"""Captures the batch inspector during a serving benchmark (``cb-serve bench serve --trace-out /
--screenshot``): the Chrome trace of the last seconds, and a headless-Chromium screenshot of the
live ``/inspect`` page."""

from __future__ import annotations

import json
import sys
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


def screenshot(root: str, out: Path, timeout_s: float = 60) -> bool:
    """Headless Chromium's screenshot of ``/inspect`` once it has drawn live steps (the tests'
    DevTools driver, ``tests/browser.py``: run from the repository's root)."""
    tests = Path.cwd() / "tests"
    if not (tests / "browser.py").is_file():
        raise SystemExit("--screenshot uses tests/browser.py: run from the repository's root")
    sys.path.insert(0, str(tests))
    from browser import open_page

    with open_page(f"{root}/inspect") as page:
        deadline = time.monotonic() + timeout_s
        while not page.evaluate("document.querySelectorAll('g.step').length >= 40"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        page.screenshot(out)
    return out.exists()


def screenshot_later(root: str, out: Path, after_s: float) -> threading.Thread:
    """Takes the screenshot ``after_s`` seconds from now, in a thread (join it before stopping the server)."""
    thread = threading.Thread(target=lambda: (time.sleep(after_s), screenshot(root, out)), daemon=True)
    thread.start()
    return thread
