"""Keeps each RayService manifest's ``serveConfigV2`` identical to its Serve config in deploy/.

``python k8s/sync_serve_config.py`` copies each config file verbatim (comments included) into
its manifest's ``serveConfigV2: |`` block (``MANIFESTS``: k8s/rayservice.yaml from
deploy/config.gpu.yaml, k8s/rayservice-tp.yaml from deploy/config.tp.yaml,
k8s/rayservice-moe.yaml from deploy/config.moe.yaml); ``--check`` only
reports which differ (tests/deploy/test_k8s.py runs the same comparison). Edit the Serve configs in
deploy/, never in the manifests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each manifest and the Serve config its serveConfigV2 is.
MANIFESTS = {
    ROOT / "k8s" / "rayservice.yaml": ROOT / "deploy" / "config.gpu.yaml",
    ROOT / "k8s" / "rayservice-tp.yaml": ROOT / "deploy" / "config.tp.yaml",
    ROOT / "k8s" / "rayservice-moe.yaml": ROOT / "deploy" / "config.moe.yaml",
}
KEY = "  serveConfigV2: |"
INDENT = "    "


def render(manifest: str, config: str, name: str = "the manifest") -> str:
    """``manifest`` with the block under ``KEY`` replaced by ``config``, indented."""
    lines = manifest.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == KEY) + 1
    except StopIteration:
        raise ValueError(f"{name} has no line {KEY!r}") from None
    end = start
    while end < len(lines) and (lines[end].startswith(INDENT) or not lines[end].strip()):
        end += 1
    while end > start and not lines[end - 1].strip():  # blank lines after the block stay outside it
        end -= 1
    block = [INDENT + line if line.strip() else "\n" for line in config.rstrip("\n").splitlines(keepends=True)]
    return "".join(lines[:start] + block + ["\n"] + lines[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a manifest is out of date; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for manifest, source in MANIFESTS.items():
        current = manifest.read_text()
        wanted = render(current, source.read_text(), manifest.name)
        if wanted == current:
            continue
        stale.append(manifest)
        if not args.check:
            manifest.write_text(wanted)
            print(f"updated {manifest.relative_to(ROOT)} from {source.relative_to(ROOT)}")
    if stale and args.check:
        for manifest in stale:
            print(f"{manifest.relative_to(ROOT)} is out of date: run python k8s/sync_serve_config.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
