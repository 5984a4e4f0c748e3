"""The MTP proposer (``speculative_config`` method ``mtp``): a checkpoint's own multi-token-prediction layers
(``model_executor/models/mtp.py``, Qwen3-Next and Qwen3.5) draft from the target's hidden states, as vLLM runs
them, with a paged KV cache of their own.

MTP row ``p`` of a sequence reads the token after it and the target's hidden state at ``p``, so each sequence has a
*shadow* here whose token ``p`` is the target's token ``p + 1``, in the MTP's block pool. After every target
forward the runner hands over each row's hidden state (``observe_hidden``); before the next step is scheduled
(``prepare``) one batched MTP pass computes every row the target has computed since, for every running sequence
(what the budget allows): the MTP cache follows the target's, prefills included. A speculating sequence whose
last computed row is that pass's last has its first draft from it; each further draft is one more pass of a
row whose token is the draft before and whose hidden state is the MTP's own output there (a ``k > 1`` chain,
the MTP layers taken in turn). Chain rows are recomputed from the target's hidden states once it has verified
them; rows the target skipped (a prefix hit) are skipped too, their cache left unwritten (drafts are only
drafts: a poorer one is rejected, never emitted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cb_serve.model_executor.device_context import device_context
from cb_serve.model_executor.model_runner import ModelRunner
from cb_serve.sequence import SchedulerOutput, Sequence, SequenceStatus
from cb_serve.spec_decode.draft_model import GREEDY, BlockPool, ShadowProposer


@dataclass
class MtpShadow:
    seq: Sequence  # token p: the target's token p + 1; its own block table and computed rows
    exact: int = 0  # rows computed from the target's hidden states (later ones: a chain's)
    hidden_start: int = 0  # the target's hidden state of row ``hidden_start + i`` is ``hidden[i]``
    hidden: torch.Tensor | None = None
    last: tuple[int, int, torch.Tensor] | None = None  # the last pass's (row, greedy token, output) of its last row


class MtpProposer(ShadowProposer):
    def __init__(
        self, runner: ModelRunner, blocks: BlockPool, max_num_batched_tokens: int, final_norm: Callable
    ) -> None:
        """``runner``: the MTP layers' (``MultiTokenPredictor``) with its own KV cache; ``final_norm``: the target's
        (its hidden states are handed over before it)."""
        super().__init__(runner, blocks)
        self.budget, self.final_norm = max_num_batched_tokens, final_norm

    @property
    def hidden_sink(self) -> Callable:
        return self.observe_hidden

    # ---- after each target forward ------------------------------------------------
    def observe_hidden(self, seqs: list[Sequence], seq_lens: list[int], query_lens: list[int], hidden) -> None:
        """The target's rows of a step (batch order; ``hidden`` before its final norm): each sequence's, kept
        until the MTP pass consumes them (rows past what the target keeps, its rejected drafts, are replaced)."""
        offset = 0
        for seq, end, n in zip(seqs, seq_lens, query_lens):
            rows, start, offset = hidden[offset : offset + n], end - n, offset + n
            shadow = self.shadows.get(id(seq))
            if shadow is None:
                shadow = self.shadows[id(seq)] = MtpShadow(_shadow_sequence(seq))
            kept = shadow.hidden
            if kept is None or not shadow.hidden_start <= start <= shadow.hidden_start + len(kept):
                shadow.hidden_start, shadow.hidden = start, rows
            else:
                shadow.hidden = torch.cat([kept[: start - shadow.hidden_start], rows])

    # ---- before the step is scheduled ---------------------------------------------
    @torch.inference_mode()
    def prepare(self, running: list[Sequence]) -> None:
        """One pass over the rows each running sequence's target computed since the last (budgeted; a shadow the
        MTP's block pool cannot hold drops its rows and skips ahead later, its cache there unwritten)."""
        with device_context(self.runner.device):
            budget, batch, rows = self.budget, [], []
            for seq in running:
                shadow = self.shadows.get(id(seq))
                if shadow is None:
                    continue
                shadow.last = None
                n = min(self._sync(seq, shadow), budget)
                if n and self.blocks.allocate(shadow.seq, n):
                    batch.append(shadow)
                    rows.append(n)
                    budget -= n
                elif n:  # no block for it: its kept rows dropped, not piled up
                    shadow.hidden = None
            if batch:
                hidden = [self._take(s, n) for s, n in zip(batch, rows)]
                self._pass(batch, rows, hidden, 0, exact=True)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        live = []
        for i, (seq, k) in enumerate(zip(seqs, num_drafts)):
            shadow = self.shadows.get(id(seq))
            if k and shadow is not None and shadow.last is not None and shadow.last[0] == seq.num_tokens - 2:
                drafts[i].append(shadow.last[1])
                live.append(i)
        with device_context(self.runner.device):
            for step in range(1, max(num_drafts, default=0)):
                live = [i for i in live if len(drafts[i]) < num_drafts[i]]
                shadows = [self.shadows[id(seqs[i])] for i in live]
                for shadow, i in zip(shadows, live):
                    shadow.seq.token_ids.append(drafts[i][-1])
                keep = [j for j, s in enumerate(shadows) if self.blocks.allocate(s.seq, 1)]
                live, shadows = [live[j] for j in keep], [shadows[j] for j in keep]
                if not live:
                    break
                self._pass(shadows, [1] * len(shadows), [s.last[2][None] for s in shadows], step, exact=False)
                for shadow, i in zip(shadows, live):
                    drafts[i].append(shadow.last[1])
        return drafts

    # ---- the passes -----------------------------------------------------------------
    def _sync(self, seq: Sequence, shadow: MtpShadow) -> int:
        """``shadow`` made the target's again (its chain rows and drafts dropped; the rows the target skipped,
        a prefix hit, skipped too): how many rows the target's hidden states now allow it to compute."""
        s = shadow.seq
        s.num_computed_tokens = shadow.exact
        del s.token_ids[shadow.exact :]
        s.token_ids.extend(seq.token_ids[shadow.exact + 1 :])
        end = min(seq.num_computed_tokens, seq.num_tokens - 1)
        if shadow.hidden is None or end <= shadow.exact:
            return 0
        gap = shadow.hidden_start - shadow.exact
        if gap > 0:  # rows the target never computed here: their cache stays unwritten
            if not self.blocks.allocate(s, gap):
                return 0
            s.num_computed_tokens = shadow.exact = shadow.hidden_start
        return max(0, min(end, shadow.hidden_start + len(shadow.hidden)) - shadow.exact)

    def _take(self, shadow: MtpShadow, n: int) -> torch.Tensor:
        """The target's (normed) hidden states of ``shadow``'s next ``n`` rows; the consumed ones dropped."""
        i = shadow.exact - shadow.hidden_start
        rows = shadow.hidden[i : i + n]
        shadow.hidden, shadow.hidden_start = shadow.hidden[i + n :], shadow.exact + n
        return self.final_norm(rows)

    def _pass(self, shadows: list[MtpShadow], rows: list[int], hidden: list, step: int, exact: bool) -> None:
        """One MTP forward over ``shadows``' next ``rows`` with their ``hidden`` inputs; each shadow whose chunk
        reaches its last token gets ``last`` (row, greedy token, output)."""
        sched = SchedulerOutput()
        sched.seqs.extend(s.seq for s in shadows)
        sched.num_scheduled_tokens.extend(rows)
        runner = self.runner
        inp = runner.prepare(sched)
        by_seq = {id(s.seq): h for s, h in zip(shadows, hidden)}
        hidden_in = torch.cat([by_seq[id(seq)] for seq in inp.seqs])
        out = runner.model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta, hidden_in, step)
        for s, n in zip(shadows, rows):
            s.seq.num_computed_tokens += n
            if exact:
                s.exact += n
        if not inp.sampling_seqs:
            return
        last = out[inp.logits_indices]
        tokens = runner.model.compute_logits(last).argmax(dim=-1).tolist()
        shadow_of = {id(s.seq): s for s in shadows}
        for j, seq in enumerate(inp.sampling_seqs):
            shadow_of[id(seq)].last = (seq.num_tokens - 1, tokens[j], last[j])


def _shadow_sequence(seq: Sequence) -> Sequence:
    shadow = Sequence(f"mtp-{seq.seq_id}", "mtp", 0, seq.token_ids[1:] or [0], GREEDY, 1)
    shadow.token_ids = list(seq.token_ids[1:])
    shadow.status = SequenceStatus.RUNNING
    return shadow
