"""How a recurrent layer walks a ragged batch: the decode rows (the first ``num_decodes``, one token each)
together in one recurrent step, then each prefill chunk on its own, each from its sequence's state slot."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cb_serve.attention.base import AttentionMetadata


def decode_slots(meta: AttentionMetadata) -> torch.Tensor:
    """The decode rows' state slots (int64, for indexing the state tensors)."""
    return meta.state_slots[: meta.num_decodes].long()


def prefill_rows(meta: AttentionMetadata) -> Iterator[tuple[slice, int]]:
    """Each prefill chunk's token rows and its sequence's state slot."""
    start = meta.num_decodes
    for row in range(meta.num_decodes, meta.num_seqs):
        end = start + meta.query_lens[row]
        yield slice(start, end), meta.state_slot_list[row]
        start = end
