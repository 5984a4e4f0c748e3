"""The model runner's persistent block-table rows gather exactly the tables the block manager's lists
hold, step after step: tables that grow, are replaced (a prefix hit, a sliding window's freed entries,
preemption) or released, in random order, with rows and width growing past their start."""

from __future__ import annotations

import random

import numpy as np

from cb_serve.kv_cache_interface import NULL_BLOCK
from cb_serve.model_executor.block_table_rows import BlockTableRows
from cb_serve.sampling_params import SamplingParams
from cb_serve.sequence import Sequence


def reference(seqs: list[Sequence]) -> np.ndarray:
    width = max(len(s.block_tables[0]) for s in seqs)
    out = np.zeros((len(seqs[0].block_tables), len(seqs), width), dtype=np.int64)
    for i, seq in enumerate(seqs):
        for g, table in enumerate(seq.block_tables):
            out[g, i, : len(table)] = table
    return out


def check(rows: BlockTableRows, seqs: list[Sequence]) -> None:
    got, want = rows.gather(seqs), reference(seqs)
    assert got.shape == want.shape
    for i, seq in enumerate(seqs):  # past a table's end: never read
        n = len(seq.block_tables[0])
        assert np.array_equal(got[:, i, :n], want[:, i, :n]), (i, seq.block_tables)


def test_rows_follow_appends_replacements_and_releases():
    rng = random.Random(0)
    groups = 2
    rows = BlockTableRows(groups, num_rows=2, width=3)  # both grow
    params = SamplingParams(max_tokens=1)
    live: list[Sequence] = []
    next_block = iter(range(10**6))
    for step in range(400):
        if len(live) < 12 and rng.random() < 0.3:
            seq = Sequence(step, f"r{step}", 0, [1], params, 1)
            seq.block_tables = [[next(next_block)] for _ in range(groups)]
            live.append(seq)
        for seq in live:
            action = rng.random()
            if action < 0.4:  # appended in place
                for table in seq.block_tables:
                    table.append(next(next_block))
            elif action < 0.5:  # a sliding window freed its first entries: a new list
                k = rng.randrange(len(seq.block_tables[0]) + 1)
                seq.block_tables = [list(seq.block_tables[0]), [NULL_BLOCK] * k + seq.block_tables[1][k:]]
            elif action < 0.55:  # preempted and readmitted with a prefix hit: new tables
                rows.release(seq)
                seq.block_tables = [[next(next_block) for _ in range(rng.randrange(1, 9))]] * groups
                seq.block_tables = [list(t) for t in seq.block_tables]
        if live and rng.random() < 0.15:  # one finishes
            rows.release(live.pop(rng.randrange(len(live))))
        if live:
            batch = rng.sample(live, rng.randrange(1, len(live) + 1))
            check(rows, batch)
    for seq in live:
        rows.release(seq)
    assert not rows.rows and sorted(rows.free) == list(range(rows.array.shape[1])), "every row back"
