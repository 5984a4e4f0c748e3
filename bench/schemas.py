"""The JSON schemas the structured-output benchmarks run: the test suite's (``tests/json_schemas.py``), test
data that the wheel does not ship."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from json_schemas import HOSTILE_SCHEMAS, SCHEMAS  # noqa: E402

__all__ = ["HOSTILE_SCHEMAS", "SCHEMAS"]
