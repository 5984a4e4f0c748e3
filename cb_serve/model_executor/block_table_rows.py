"""Each running sequence's block tables, kept in a row of one persistent array across steps (vLLM's
``BlockTable`` in its ``InputBatch``): a step stages only the block ids that are new since the
sequence's last step, then gathers its batch's rows in one indexed copy, so the host cost of the
block tables per step does not grow with the context length.

The contract with the block manager (``Sequence.block_tables``): a sequence's tables are only ever
appended to in place; any other change (freed, a prefix hit, a sliding window's entries turned
``NULL_BLOCK``) gives the sequence a new outer list. A row remembers the list it copied and how many
entries: the same list with more entries stages the tail, another list rewrites the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cb_serve.sequence import Sequence


@dataclass
class _Row:
    index: int
    tables: list[list[int]]  # the sequence's ``block_tables`` when copied (held: its identity stays unique)
    num_synced: int  # entries copied of each group's table


class BlockTableRows:
    """Rows of ``[num_groups, rows, width]`` block ids; a sequence holds one from its first step until
    ``release`` (finished or preempted). Rows and width grow when short (they start at
    ``max_num_seqs`` and the widest table ``max_model_len`` allows)."""

    def __init__(self, num_groups: int, num_rows: int, width: int) -> None:
        assert num_groups > 0
        self.array = np.zeros((num_groups, max(1, num_rows), max(1, width)), dtype=np.int64)
        self.rows: dict[int | str, _Row] = {}  # seq id -> its row
        self.free = list(range(self.array.shape[1] - 1, -1, -1))  # a stack: row 0 first

    def gather(self, seqs: list[Sequence]) -> np.ndarray:
        """The block tables of ``seqs`` in order, ``[num_groups, len(seqs), widest]`` (a copy; entries past
        a sequence's table are stale or zero: never read)."""
        index = [self._synced(seq) for seq in seqs]
        width = max(len(seq.block_tables[0]) for seq in seqs)
        return self.array[:, index, :width]

    def release(self, seq: Sequence) -> None:
        """``seq`` holds no blocks any more: its row is free."""
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.free.append(row.index)

    def _synced(self, seq: Sequence) -> int:
        tables = seq.block_tables
        n = len(tables[0])
        row = self.rows.get(seq.seq_id)
        if row is None:
            row = self.rows[seq.seq_id] = _Row(self._take(), tables, 0)
        elif row.tables is not tables:  # replaced: rewrite the row
            row.tables, row.num_synced = tables, 0
        start = row.num_synced
        if start < n:
            if n > self.array.shape[2]:
                self._grow(width=max(n, 2 * self.array.shape[2]))
            assert len(tables) == self.array.shape[0], "a table per KV-cache group"
            for g, table in enumerate(tables):
                self.array[g, row.index, start:n] = table[start:] if start else table
            row.num_synced = n
        return row.index

    def _take(self) -> int:
        if not self.free:
            old = self.array.shape[1]
            self._grow(rows=2 * old)
            self.free = list(range(2 * old - 1, old - 1, -1))
        return self.free.pop()

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        g, r, w = self.array.shape
        grown = np.zeros((g, rows or r, width or w), dtype=self.array.dtype)
        grown[:, :r, :w] = self.array
        self.array = grown
