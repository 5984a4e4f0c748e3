"""Verifying drafts against the target model's distributions (pure functions, one sequence).

- **Greedy:** the longest prefix of drafts equal to the target's argmax, then the target's own
  next token: the output equals non-speculative greedy decoding token for token.
- **Sampling** (Leviathan et al., 2023): draft ``d_i`` with proposal ``q_i`` is accepted with
  probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the token is drawn from
  ``max(p_i - q_i, 0)`` renormalized, and after ``k`` acceptances a bonus token from ``p_k``. Every
  emitted token is then distributed exactly as the target's. An n-gram draft has a one-hot ``q``
  (``q_i(d_i) = 1``): accept with ``p_i(d_i)``, on rejection draw from ``p_i`` without ``d_i``.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """The emitted tokens: ``target`` (the argmax at each of the ``len(drafts) + 1`` positions) up
    to and including its first disagreement with ``drafts``."""
    assert len(target) == len(drafts) + 1
    n = next((i for i, (d, t) in enumerate(zip(drafts, target)) if d != t), len(drafts))
    return target[: n + 1]


def rejection_sample(
    drafts: list[int],
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The emitted tokens for ``drafts`` given the target's ``probs`` ``[k + 1, V]`` (float, rows
    summing to 1) and the drafter's ``draft_probs`` ``[k, V]`` (None: one-hot drafts). Draws come
    from ``generator`` in a fixed order (one uniform per examined draft, then one categorical), so a
    seeded request stays reproducible."""
    k = len(drafts)
    assert probs.shape[0] == k + 1 and (draft_probs is None or draft_probs.shape[0] == k)
    out: list[int] = []
    for i, d in enumerate(drafts):
        p = probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        accept = min(1.0, float(p[d]) / q_d) if q_d > 0 else 0.0
        if float(torch.rand((), generator=generator)) < accept:
            out.append(d)
            continue
        residual = p.clone()
        if draft_probs is None:
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p  # p == q exactly: any draw from p is right
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out
