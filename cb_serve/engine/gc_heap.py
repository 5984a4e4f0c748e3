"""The heap the engine starts with, kept out of the garbage collector's way while it steps.

A step allocates many short-lived objects, so CPython's collector runs every few steps, and each
full collection walks every tracked object in the process: the model's modules, the tokenizer, the
configs, all of which live as long as the engine. vLLM freezes that heap after start-up
(``gc.freeze()``); here it is frozen for as long as requests run (``LLM.generate``, the
``AsyncLLM`` loop) and unfrozen after, so objects of an engine dropped later are collected as
usual (a frozen cycle would never be). Freezing and unfreezing are O(1); they are process-wide, so
nested or concurrent users simply share one frozen heap until the first of them leaves.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap(collect: bool = False) -> Iterator[None]:
    """Every object alive now is left out of collections until the block ends (``collect``: after
    collecting what is garbage already, which would otherwise wait for the end)."""
    if collect:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
