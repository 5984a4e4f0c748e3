"""How a recurrent layer walks a ragged batch: the decode rows (the first ``num_decodes``, one token each)
together in one recurrent step; the rows that verify drafts (speculative decoding) position by position, each
position a decode step of its own whose state is kept where later positions may be rejected
(``VerifyPosition``); then each prefill chunk on its own, each from its sequence's state slot."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from cb_serve.attention.base import AttentionMetadata, host_to_device


def decode_slots(meta: AttentionMetadata) -> torch.Tensor:
    """The decode rows' state slots (int64, for indexing the state tensors)."""
    return meta.state_slots[: meta.num_decodes].long()


def prefill_rows(meta: AttentionMetadata) -> Iterator[tuple[slice, int]]:
    """Each prefill chunk's token rows and its sequence's state slot (not the rows verifying drafts)."""
    start = meta.num_decodes
    for row in range(meta.num_decodes, meta.num_seqs):
        end = start + meta.query_lens[row]
        if row not in meta.verify_rows:
            yield slice(start, end), meta.state_slot_list[row]
        start = end


@dataclass(frozen=True)
class VerifyPosition:
    """Token ``j`` of every row verifying drafts that has one, run as one decode step from the rows' slots. A
    row with tokens after it keeps its state after it (``keep_from`` -> ``keep_to``, its verify slot ``j``): if
    the next draft is rejected, that state goes back into the slot (``StateCache.begin_step``'s rollbacks)."""

    tokens: torch.Tensor  # int64 [N]: batch indices
    slots: torch.Tensor  # int64 [N]
    keep_from: torch.Tensor  # int64 [M], M <= N
    keep_to: torch.Tensor  # int64 [M]


def verify_positions(
    rows: list[int],
    cu_seqlens_q: np.ndarray,
    query_lens: list[int],
    slots: list[int],
    verify_slot: Callable[[int, int], int],
    device: torch.device,
) -> list[VerifyPosition]:
    """The positions of the verifying ``rows`` (batch rows; ``verify_slot(slot, j)``: where a slot's state after
    position ``j`` is kept)."""
    positions = []
    for j in range(max((query_lens[r] for r in rows), default=0)):
        live = [r for r in rows if query_lens[r] > j]
        kept = [r for r in live if query_lens[r] > j + 1]
        columns = (
            [int(cu_seqlens_q[r]) + j for r in live],
            [slots[r] for r in live],
            [slots[r] for r in kept],
            [verify_slot(slots[r], j) for r in kept],
        )
        tensors = (host_to_device(torch.tensor(c, dtype=torch.int64), device) for c in columns)
        positions.append(VerifyPosition(*tensors))
    return positions


def keep_verify_states(position: VerifyPosition, states: tuple[torch.Tensor, ...]) -> None:
    """After ``position``'s step: the states of the rows with tokens after it, copied to their verify slots."""
    if position.keep_to.numel():
        for t in states:
            t.index_copy_(0, position.keep_to, t.index_select(0, position.keep_from))
