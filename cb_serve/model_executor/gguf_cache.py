"""The config and tokenizer transformers reads out of a GGUF file, kept on disk as HF files.

transformers parses a GGUF file's whole metadata (every vocabulary string, one at a time) to build
its config, again for its tokenizer, and again with the weights: seconds for a 49k vocabulary,
tens of seconds for Gemma's 262k. ``loader.memoized_per_gguf`` keeps them per process; this keeps
them across processes (each Ray Serve replica and router, each test worker): under
``$CB_SERVE_CACHE_DIR`` (default ``~/.cache/cb_serve/gguf``; empty: off), keyed by the file's path,
size and modification time. An entry is written whole (a temporary directory renamed into place,
so concurrent writers are safe) and one that fails to load is parsed again and replaced.

The cache is bounded: each write evicts the least recently used entries (a read marks its entry used)
until the whole takes at most ``$CB_SERVE_CACHE_MAX_GB`` (default 8), never the entry just written.
Keys follow a file's path and time, so a file assembled anew (a fresh virtual environment) adds an
entry each time; unbounded, those filled CI's disk.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
CACHE_ENV = "CB_SERVE_CACHE_DIR"
MAX_ENV = "CB_SERVE_CACHE_MAX_GB"
DEFAULT_MAX_GB = 8.0
COMPLETE = "cb_serve_complete"  # written last: the entry is whole
T = TypeVar("T")


def cache_root() -> Path | None:
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return Path(value) if value else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cb_serve" / "gguf"


def entry_dir(stamp: tuple[str, int, int] | None, kind: str) -> Path | None:
    root = cache_root()
    if stamp is None or root is None:
        return None
    return root / hashlib.sha256(repr(stamp).encode()).hexdigest()[:32] / kind


def cached(
    stamp: tuple[str, int, int] | None,
    kind: str,
    parse: Callable[[], T],
    save: Callable[[T, str], Any],
    reload: Callable[[str], T],
) -> T:
    """``reload(dir)`` of the cached entry, or ``parse()`` then ``save(value, dir)`` into the cache."""
    directory = entry_dir(stamp, kind)
    if directory is None:
        return parse()
    if (directory / COMPLETE).is_file():
        try:
            value = reload(str(directory))
            mark_used(directory.parent)
            return value
        except Exception as e:  # noqa: BLE001 - a bad entry: parse again and replace it
            logger.warning("the cached %s at %s did not load (%s); parsing the GGUF file again", kind, directory, e)
            shutil.rmtree(directory, ignore_errors=True)
    value = parse()
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{kind}."))
        save(value, str(scratch))
        (scratch / COMPLETE).touch()
        try:
            scratch.rename(directory)
        except OSError:  # another process wrote it first
            shutil.rmtree(scratch, ignore_errors=True)
        prune(keep=directory.parent)  # (the rename into it marked its entry used)
    except OSError as e:  # a read-only or full disk: serve without the cache
        logger.warning("could not cache the %s parsed from the GGUF file under %s: %s", kind, directory.parent, e)
    return value


def max_bytes() -> int:
    value = os.environ.get(MAX_ENV, "")
    gigabytes = float(value) if value else DEFAULT_MAX_GB
    assert gigabytes >= 0, f"{MAX_ENV} must be >= 0, got {value!r}"
    return int(gigabytes * 2**30)


def mark_used(path: Path) -> None:
    """Record a use of an entry (a directory or a file under the root) for ``prune``'s order."""
    try:
        os.utime(path)
    except OSError:  # evicted meanwhile, or a read-only cache
        pass


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prune(keep: Path | None = None, limit: int | None = None) -> list[Path]:
    """Evict the least recently used entries until the cache takes at most ``limit`` bytes
    (``max_bytes()``); ``keep`` (the entry just written) stays. Returns the evicted paths."""
    root = cache_root()
    limit = max_bytes() if limit is None else limit
    if root is None or not root.is_dir():
        return []
    entries: list[tuple[float, int, Path]] = []
    for path in root.iterdir():
        children = path.iterdir() if path.is_dir() and path.name == "quant-groups" else [path]
        for entry in children:
            if entry.name.startswith("."):  # a writer's scratch
                continue
            try:
                entries.append((entry.stat().st_mtime, _size(entry), entry))
            except OSError:  # another process evicted it
                continue
    total = sum(size for _, size, _ in entries)
    evicted = []
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if keep is not None and entry == keep:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        total -= size
        evicted.append(entry)
    if evicted:
        logger.info("evicted %d entries from the GGUF cache at %s (over %.1f GB)", len(evicted), root, limit / 2**30)
    return evicted
