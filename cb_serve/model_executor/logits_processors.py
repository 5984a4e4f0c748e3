"""Per-request logits processors of one sampling step, applied in place to its float32 ``[N, vocab]`` logits in
vLLM v1's order (``vllm/v1/sample/sampler.py``, ``Sampler.apply_logits_processors``): ``allowed_token_ids``,
``bad_words``, then the non-argmax-invariant processors (``min_tokens``, which is the sampler's ``banned``, and
``logit_bias``), then the penalties as ``vllm/model_executor/layers/utils.py``'s ``apply_penalties``:
``repetition_penalty`` over every token of the prompt or the output (a positive logit divided, any other
multiplied), then ``frequency_penalty`` times each token's count in the output and ``presence_penalty`` once per
token of the output subtracted. The -inf masks commute with each other and with the grammar's; only the bias must
come before the penalties. Logprobs are of the logits before all of this (vLLM's ``raw_logprobs``).

A step builds one ``LogitsProcessors`` from its sampling sequences, or None where no row has a processor (then a
predicate per row is all it costs). A request's bias and allowed ids become tensors once (kept on its
``SamplingParams``); the penalties' counts are one ``scatter_add_`` over the rows' padded tokens; bad words are
matched in Python, one comparison per word and row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cb_serve.attention.base import host_to_device
from cb_serve.sampling_params import SamplingParams
from cb_serve.sequence import Sequence

NEG_INF = float("-inf")


@dataclass
class RequestTensors:
    """One request's processor data, on the CPU, built on first use and kept on its ``SamplingParams``."""

    bias_ids: torch.Tensor  # int64 [B]: ``logit_bias``'s token ids
    bias_values: torch.Tensor  # float32 [B]: their (clamped) biases
    allowed_ids: torch.Tensor | None  # int64: ``allowed_token_ids``, sorted, without repeats
    bad_words: list[tuple[list[int], int]]  # (the tokens before the last, the last) of each bad word

    @classmethod
    def of(cls, params: SamplingParams) -> RequestTensors:
        cached = params._processor_tensors
        if cached is None:
            bias = params.logit_bias or {}
            allowed = params.allowed_token_ids
            cached = cls(
                torch.tensor(list(bias), dtype=torch.int64),
                torch.tensor(list(bias.values()), dtype=torch.float32),
                torch.tensor(sorted(set(allowed)), dtype=torch.int64) if allowed else None,
                [(list(word[:-1]), word[-1]) for word in params.bad_words_token_ids],
            )
            params._processor_tensors = cached
        return cached


def bad_word_bans(seq: Sequence, words: list[tuple[list[int], int]]) -> list[int]:
    """The last tokens of the bad words whose other tokens end ``seq``'s output (vLLM matches the output
    only, not the prompt; a one-token word is always banned). Longer words step synchronously: no pending token."""
    assert not seq.num_pending_tokens or all(not prefix for prefix, _ in words), seq
    tokens, num_output = seq.token_ids, seq.num_output_tokens
    return [
        last for prefix, last in words if not prefix or (len(prefix) <= num_output and tokens[-len(prefix) :] == prefix)
    ]


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.frequency_penalty) or bool(params.presence_penalty)


PrevSampled = tuple[torch.Tensor, dict]  # async scheduling: the step in flight's ids and each sequence's row in them


@dataclass
class Penalties:
    """The penalized rows: their tokens and penalties. Only the logits of the rows' tokens change: they are
    gathered, penalized and written back (a token listed twice gets the same value twice). A row whose last
    token is pending (async scheduling: sampled by the step in flight) has a placeholder there, filled on the
    device from that step's ids (``pending``), as the step's input ids are."""

    rows: torch.Tensor  # int64 [R]
    tokens: torch.Tensor  # int64 [R, L]: the prompt's (with a repetition penalty) and the output's, then the first
    in_output: torch.Tensor  # float32 [R, L]: 1 at the output's tokens (not the prompt's, not the padding)
    repetition: torch.Tensor  # float32 [R]
    frequency: torch.Tensor  # float32 [R]
    presence: torch.Tensor  # float32 [R]
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (row, column, row in prev ids)
    prev_ids: torch.Tensor | None = None  # the step in flight's sampled ids (on the device)

    @classmethod
    def from_rows(cls, seqs: list[Sequence], rows: list[int], prev: PrevSampled | None = None) -> Penalties | None:
        """``seqs[row]`` for each of ``rows``: the tokens padded in numpy, one iteration per row. A row without a
        repetition penalty needs its output's tokens only (none yet: nothing to do)."""
        starts = {row: 0 if seqs[row].params.repetition_penalty != 1.0 else seqs[row].num_prompt_tokens for row in rows}
        ends = {row: seqs[row].num_tokens + seqs[row].num_pending_tokens for row in rows}
        rows = [row for row in rows if ends[row] > starts[row]]
        if not rows:
            return None
        lengths = [ends[row] - starts[row] for row in rows]
        tokens = np.empty((len(rows), max(lengths)), dtype=np.int64)
        in_output = np.zeros(tokens.shape, dtype=np.float32)
        pending: list[tuple[int, int, int]] = []
        for i, (row, length) in enumerate(zip(rows, lengths)):
            seq, start = seqs[row], starts[row]
            known = seq.num_tokens - start
            tokens[i, :known] = seq.token_ids[start:] if start else seq.token_ids
            if known < length:  # one pending token, sampled by the step in flight
                assert prev is not None and length == known + 1, (seq, known, length)
                pending.append((i, known, prev[1][seq.seq_id]))
                tokens[i, known] = 0  # padding that copies it is a token of no count in a row without repetition
            tokens[i, length:] = tokens[i, 0]
            in_output[i, seq.num_prompt_tokens - start : length] = 1.0
        params = [seqs[row].params for row in rows]

        def floats(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)

        out = cls(
            torch.tensor(rows, dtype=torch.int64),
            torch.from_numpy(tokens),
            torch.from_numpy(in_output),
            floats("repetition_penalty"),
            floats("frequency_penalty"),
            floats("presence_penalty"),
        )
        if pending:
            out.pending = tuple(torch.tensor(column, dtype=torch.int64) for column in zip(*pending))
            out.prev_ids = prev[0]
        return out

    def apply(self, logits: torch.Tensor) -> None:
        device = logits.device
        rows, tokens = host_to_device(self.rows, device)[:, None], host_to_device(self.tokens, device)
        if self.pending is not None:
            at_row, at_column, prev_row = (host_to_device(t, device) for t in self.pending)
            tokens[at_row, at_column] = self.prev_ids[prev_row]
        x = logits[rows, tokens]
        rep = host_to_device(self.repetition, device)[:, None]  # 1 (exact: x / 1 == x * 1 == x): output tokens only
        x = torch.where(x > 0, x / rep, x * rep)
        if bool((self.frequency != 0).any() or (self.presence != 0).any()):
            counts = torch.zeros(tokens.shape[0], logits.shape[1], device=device)
            counts = counts.scatter_add_(1, tokens, host_to_device(self.in_output, device)).gather(1, tokens)
            frequency, presence = (host_to_device(t, device)[:, None] for t in (self.frequency, self.presence))
            x = x - frequency * counts - presence * (counts > 0)
        logits[rows, tokens] = x


def _cat_rows(rows: list[int], tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(each tensor's row repeated once per element, the tensors concatenated)."""
    sizes = torch.tensor([len(t) for t in tensors], dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64).repeat_interleave(sizes), torch.cat(tensors)


@dataclass
class LogitsProcessors:
    """The logits processors of one step's sampling rows."""

    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, row of each id, ids)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row, token id) of each bad word's banned last token
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token id, bias) of each entry
    penalties: Penalties | None

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], prev: PrevSampled | None = None) -> LogitsProcessors | None:
        """Row ``i`` is ``seqs[i]``'s; None when no row has a processor. ``prev``: async scheduling's step in
        flight, whose tokens the penalties count (bad words of one token need no tokens; longer ones make a
        request step synchronously)."""
        active = [row for row, seq in enumerate(seqs) if seq.params.has_logits_processors]
        if not active:
            return None
        allowed_rows, allowed_ids, bias_rows, bias_ids, bias_values = [], [], [], [], []
        banned: list[tuple[int, int]] = []
        penalized = []
        for row in active:
            seq = seqs[row]
            data = RequestTensors.of(seq.params)
            if data.allowed_ids is not None:
                allowed_rows.append(row)
                allowed_ids.append(data.allowed_ids)
            if data.bad_words:
                banned.extend((row, token) for token in bad_word_bans(seq, data.bad_words))
            if len(data.bias_ids):
                bias_rows.append(row)
                bias_ids.append(data.bias_ids)
                bias_values.append(data.bias_values)
            if has_penalty(seq.params):
                penalized.append(row)
        allowed = (torch.tensor(allowed_rows), *_cat_rows(allowed_rows, allowed_ids)) if allowed_rows else None
        bias = (*_cat_rows(bias_rows, bias_ids), torch.cat(bias_values)) if bias_rows else None
        return cls(
            allowed,
            tuple(torch.tensor(list(column), dtype=torch.int64) for column in zip(*banned)) if banned else None,
            bias,
            Penalties.from_rows(seqs, penalized, prev) if penalized else None,
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Applies every processor to ``logits`` (float32 ``[N, vocab]``), in place."""
        device = logits.device
        if self.allowed is not None:
            rows, id_rows, ids = (host_to_device(t, device) for t in self.allowed)
            kept = logits[id_rows, ids]
            logits[rows] = NEG_INF
            logits[id_rows, ids] = kept
        if self.banned is not None:
            logits[host_to_device(self.banned[0], device), host_to_device(self.banned[1], device)] = NEG_INF
        if self.bias is not None:
            rows, ids, values = (host_to_device(t, device) for t in self.bias)
            logits.index_put_((rows, ids), values, accumulate=True)
        if self.penalties is not None:
            self.penalties.apply(logits)
