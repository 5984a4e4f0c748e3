"""Command-line tools the tests run from Debian packages (``make test-deps`` installs them)."""

from __future__ import annotations

import os
import shutil

import pytest


def prometheus_tool(name: str) -> str:
    """The path of ``name`` (``prometheus`` or ``promtool``, both in Debian's ``prometheus``
    package). Missing: a skip, or a failure with ``CB_SERVE_REQUIRE_PROMETHEUS=1`` (CI)."""
    binary = shutil.which(name)
    if binary is None and os.environ.get("CB_SERVE_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(f"`{name}` is not installed and CB_SERVE_REQUIRE_PROMETHEUS=1")
    if binary is None:
        pytest.skip(f"`{name}` is not installed (Debian/Ubuntu: apt-get install -y prometheus)")
    return binary
