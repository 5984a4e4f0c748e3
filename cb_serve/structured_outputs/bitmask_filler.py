"""Where structured outputs join the step: the constrained rows' bitmask is filled on its own
thread while the forward pass runs, and the sampler applies it before any filtering."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import torch

from cb_serve.structured_outputs.base import GrammarMatcher, allocate_bitmask

logger = logging.getLogger(__name__)


class BitmaskFiller:
    """``start`` the step's fill (None: no constrained row), then take ``result()`` before sampling:
    ``(rows, bitmask, fill_s)`` with bitmask row ``i`` for sampling row ``rows[i]``, and the wall
    seconds the fill took on this thread."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cb-serve-bitmask")

    def start(self, matchers: list[tuple[int, GrammarMatcher]]) -> concurrent.futures.Future | None:
        if not matchers:
            return None
        return self._pool.submit(self._fill, matchers)

    def _fill(self, matchers: list[tuple[int, GrammarMatcher]]) -> tuple[list[int], torch.Tensor, float]:
        start = time.perf_counter()
        bitmask = allocate_bitmask(len(matchers), self.vocab_size)
        for i, (_, matcher) in enumerate(matchers):
            try:
                matcher.fill_bitmask(bitmask, i)
            except Exception:  # noqa: BLE001 - that row stays unmasked; its request fails when it accepts
                logger.exception("filling a grammar bitmask failed")
                bitmask[i] = -1
        return [row for row, _ in matchers], bitmask, time.perf_counter() - start
