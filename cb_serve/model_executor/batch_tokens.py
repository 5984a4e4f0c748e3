"""Which tokens a step's batch carries and which of its rows sample: the flattening half of
``ModelRunner.prepare`` (pure functions of the scheduled sequences, in batch order)."""

from __future__ import annotations

import numpy as np

from cb_serve.sequence import Sequence


def flatten_tokens(
    seqs: list[Sequence], starts: list[int], ends: list[int], prev_rows: dict[int | str, int]
) -> tuple[list[int], list[int], list[int]]:
    """The batch's token ids (each sequence's ``starts[i]:ends[i]``, with its drafts past its tokens), and for
    async scheduling the tokens the step in flight sampled: a placeholder here, its index in the batch and its
    row in that step's ids (``prev_rows``), filled on the device."""
    token_ids: list[int] = []
    fill_index: list[int] = []
    fill_rows: list[int] = []
    for seq, start, end in zip(seqs, starts, ends):
        token_ids.extend(seq.token_ids[start:end])
        if end > seq.num_tokens:
            if seq.num_pending_tokens:  # its last token is the step in flight's
                assert end == seq.num_tokens + 1 and not seq.spec_token_ids, seq
                fill_index.append(len(token_ids))
                fill_rows.append(prev_rows[seq.seq_id])
                token_ids.append(0)
            else:  # its drafts, verified in this step
                token_ids.extend(seq.spec_token_ids[: end - seq.num_tokens])
    return token_ids, fill_index, fill_rows


def sampling_rows(
    seqs: list[Sequence], seq_lens: list[int], cu_q: np.ndarray
) -> tuple[list[int], list[int], np.ndarray]:
    """The sequences that sample (caught up with their tokens, pending ones and drafts), each one's logits rows
    (1, or a speculating one's 1 + k) and those rows' token indices in the batch."""
    sampling = [
        i
        for i, (s, end) in enumerate(zip(seqs, seq_lens))
        if end == s.num_tokens + s.num_pending_tokens + len(s.spec_token_ids)
    ]
    rows_of = [1 + len(seqs[i].spec_token_ids) for i in sampling]
    if len(rows_of) == sum(rows_of):  # no drafts: each sampling sequence's last token
        return sampling, rows_of, cu_q[np.asarray(sampling, dtype=np.int64) + 1] - 1
    indices = [cu_q[i + 1] - n + j for i, n in zip(sampling, rows_of) for j in range(n)]
    return sampling, rows_of, np.asarray(indices, dtype=np.int64)
