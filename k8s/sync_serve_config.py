"""Keeps k8s/rayservice.yaml's ``serveConfigV2`` identical to deploy/config.gpu.yaml.

``python k8s/sync_serve_config.py`` copies the config file verbatim (comments included) into
the manifest's ``serveConfigV2: |`` block; ``--check`` only reports whether they differ
(tests/test_k8s.py runs the same comparison). Edit the Serve config in deploy/config.gpu.yaml,
never in the manifest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "deploy" / "config.gpu.yaml"
MANIFEST = ROOT / "k8s" / "rayservice.yaml"
KEY = "  serveConfigV2: |"
INDENT = "    "


def render(manifest: str, config: str) -> str:
    """``manifest`` with the block under ``KEY`` replaced by ``config``, indented."""
    lines = manifest.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == KEY) + 1
    except StopIteration:
        raise ValueError(f"{MANIFEST.name} has no line {KEY!r}") from None
    end = start
    while end < len(lines) and (lines[end].startswith(INDENT) or not lines[end].strip()):
        end += 1
    while end > start and not lines[end - 1].strip():  # blank lines after the block stay outside it
        end -= 1
    block = [INDENT + line if line.strip() else "\n" for line in config.rstrip("\n").splitlines(keepends=True)]
    return "".join(lines[:start] + block + ["\n"] + lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the manifest is out of date; write nothing")
    args = parser.parse_args(argv)
    current = MANIFEST.read_text()
    wanted = render(current, SOURCE.read_text())
    if wanted == current:
        return 0
    if args.check:
        print(f"{MANIFEST.relative_to(ROOT)} is out of date: run python k8s/sync_serve_config.py", file=sys.stderr)
        return 1
    MANIFEST.write_text(wanted)
    print(f"updated {MANIFEST.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
