"""A real headless Chromium driven over the DevTools protocol (Debian's ``chromium``; no
Selenium): open a page, let its scripts run, read the live DOM and take screenshots."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


def chromium() -> str:
    """The browser binary; installed from Debian when missing and we are root, else skip (or
    fail, with ``CB_SERVE_REQUIRE_CHROMIUM`` set, as in CI)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            "apt-get install -y -qq --no-install-recommends chromium || "
            "(apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium)",
            shell=True,
            capture_output=True,
            timeout=600,
        )
        if path := shutil.which("chromium"):
            return path
    message = "headless Chromium is not installed and could not be (Debian package 'chromium')"
    if os.environ.get("CB_SERVE_REQUIRE_CHROMIUM"):
        pytest.fail(message)
    pytest.skip(message)


class Page:
    def __init__(self, ws) -> None:
        self.ws, self.next_id = ws, 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg["result"]

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def dom(self) -> str:
        return self.evaluate("document.documentElement.outerHTML")

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


@contextmanager
def open_page(url: str, width: int = 1400, height: int = 1000) -> Iterator[Page]:
    from websockets.sync.client import connect

    profile = tempfile.mkdtemp(prefix="cb-serve-chromium-")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"]
    flags += [f"--window-size={width},{height}", "--remote-debugging-port=0", f"--user-data-dir={profile}"]
    cmd = [chromium(), *flags, "about:blank"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = Path(profile, "DevToolsActivePort")
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        target = next(t for t in targets if t["type"] == "page")
        with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            page = Page(ws)
            page.call("Page.enable")
            page.call("Page.navigate", url=url)
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)
