"""The config and tokenizer transformers reads out of a GGUF file, kept on disk as HF files.

transformers parses a GGUF file's whole metadata (every vocabulary string, one at a time) to build
its config, again for its tokenizer, and again with the weights: seconds for a 49k vocabulary,
tens of seconds for Gemma's 262k. ``loader.memoized_per_gguf`` keeps them per process; this keeps
them across processes (each Ray Serve replica and router, each test worker): under
``$CB_SERVE_CACHE_DIR`` (default ``~/.cache/cb_serve/gguf``; empty: off), keyed by the file's path,
size and modification time. An entry is written whole (a temporary directory renamed into place,
so concurrent writers are safe) and one that fails to load is parsed again and replaced.
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
            return reload(str(directory))
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
    except OSError as e:  # a read-only or full disk: serve without the cache
        logger.warning("could not cache the %s parsed from the GGUF file under %s: %s", kind, directory.parent, e)
    return value
