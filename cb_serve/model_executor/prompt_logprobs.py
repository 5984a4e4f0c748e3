"""Prompt logprobs (vLLM's ``prompt_logprobs``), computed in the step that runs the prefill chunk
holding those tokens: prompt token ``k >= 1`` gets the log-softmax of the logits at position
``k - 1`` (its own logprob and rank, and the top ``prompt_logprobs`` tokens), from the same
forward pass as the chunk's KV. A chunked prompt gets them chunk by chunk; a sequence recomputed
after preemption skips those it has. The prefix cache is not read for a sequence whose prompt
logprobs are incomplete (``Sequence.needs_prompt_logprobs``): its prompt is recomputed, as vLLM v1
does, so a cached prompt gets the same numbers as a fresh one.

The logits rows are taken in slices of ``SLICE_ROWS`` (a long chunk's full logits would not fit):
every tensor-parallel rank takes the same slices, in step with the LM head's collectives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cb_serve.outputs import Logprob
from cb_serve.sequence import Sequence

SLICE_ROWS = 256


@dataclass
class PromptLogprobRows:
    """The step's prompt-logprob rows: ``rows[0]`` the flat token index whose logits are read,
    ``rows[1]`` the prompt token they predict; ``owners`` each sequence's count, in row order."""

    rows: np.ndarray  # int64 [2, R]
    owners: list[tuple[Sequence, int]]

    @property
    def top_k(self) -> int:
        return max(seq.params.prompt_logprobs or 0 for seq, _ in self.owners)


def plan(seqs: list[Sequence], starts: list[int], seq_lens: list[int], cu_q: np.ndarray) -> PromptLogprobRows | None:
    """Rows for every sequence that wants prompt logprobs and computes prompt positions this step."""
    index, target, owners = [], [], []
    for i, (seq, start, end) in enumerate(zip(seqs, starts, seq_lens)):
        if not seq.needs_prompt_logprobs:
            continue
        # Entries so far: the first token's (None) and one per token after it, in order.
        lo, hi = max(start, max(1, len(seq.prompt_logprobs)) - 1), min(end, seq.num_prompt_tokens - 1)
        if lo >= hi:
            continue
        positions = np.arange(lo, hi)
        index.append(cu_q[i] + positions - start)
        target.append(np.asarray(seq.token_ids[lo + 1 : hi + 1]))
        owners.append((seq, hi - lo))
    if not owners:
        return None
    return PromptLogprobRows(np.stack([np.concatenate(index), np.concatenate(target)]).astype(np.int64), owners)


@torch.inference_mode()
def compute(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logprobs [R], target ranks [R], top-k logprobs [R, k], top-k ids [R, k]) of the rows
    of ``hidden``, ``SLICE_ROWS`` at a time."""
    parts = []
    for lo in range(0, hidden.shape[0], SLICE_ROWS):
        logprobs = torch.log_softmax(compute_logits(hidden[lo : lo + SLICE_ROWS]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[lo : lo + SLICE_ROWS, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        parts.append((chosen[:, 0], ranks, top[0], top[1]))
    return tuple(torch.cat([p[j] for p in parts]) for j in range(4))  # type: ignore[return-value]


def entries(
    plan_rows: PromptLogprobRows, computed: tuple[torch.Tensor, ...]
) -> list[tuple[Sequence, list[dict[int, Logprob]]]]:
    """Per owning sequence, its new prompt-logprob entries: its top ``prompt_logprobs`` tokens (ranked)
    and the prompt token itself."""
    chosen, ranks, top_vals, top_ids = (t.tolist() for t in computed)
    targets = plan_rows.rows[1].tolist()
    out, row = [], 0
    for seq, count in plan_rows.owners:
        k = seq.params.prompt_logprobs or 0
        new = []
        for r in range(row, row + count):
            entry = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(zip(top_ids[r][:k], top_vals[r][:k]), 1)}
            entry.setdefault(targets[r], Logprob(chosen[r], ranks[r]))
            new.append(entry)
        out.append((seq, new))
        row += count
    return out
