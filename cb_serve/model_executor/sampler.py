"""Batched sampling: logits processors (``logits_processors``), greedy, temperature, top-k, top-p, min-p,
per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cb_serve import cpu_ops
from cb_serve.attention.base import host_to_device
from cb_serve.model_executor.layers.greedy_head import greedy_tokens
from cb_serve.model_executor.logits_processors import LogitsProcessors, PrevSampled
from cb_serve.outputs import Logprob
from cb_serve.sequence import Sequence
from cb_serve.structured_outputs.base import apply_bitmask

CPU = torch.device("cpu")


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of the sequences that sample this step."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_k: torch.Tensor  # [N] int64; <= 0 = off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    banned: list[tuple[int, list[int]]]  # (row, token ids that may not be sampled yet: min_tokens)
    all_greedy: bool
    grammar: tuple[list[int], torch.Tensor] | None = None  # (rows, bitmask) of the constrained rows
    processors: LogitsProcessors | None = None  # penalties, logit_bias, allowed_token_ids, bad_words (None: no row)

    @classmethod
    def from_seqs(
        cls, seqs: list[Sequence], prev: PrevSampled | None = None, device: torch.device = CPU
    ) -> SamplingBatch:
        """``prev``: async scheduling's step in flight (its sampled ids, each sequence's row), whose tokens the
        penalties count on the device; ``device``: where the logits are (a seeded row draws there)."""
        params = [s.params for s in seqs]
        banned = []
        for row, seq in enumerate(seqs):
            token_ids = seq.banned_token_ids()
            if token_ids:
                banned.append((row, token_ids))
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            generators=[s.generator_on(device) for s in seqs],
            num_logprobs=[p.logprobs for p in params],
            banned=banned,
            all_greedy=all(p.greedy for p in params),
            processors=LogitsProcessors.from_seqs(seqs, prev),
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row: top-k tokens and the sampled one (no text yet)


def apply_grammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """``apply_bitmask``, in one pass of C++ for float32 logits on the CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.available():
        cpu_ops.apply_token_bitmask(logits, bitmask, rows)
    else:
        apply_bitmask(logits, bitmask, rows)


def takes_raw_argmax(seqs: list[Sequence]) -> bool:
    """Each sequence's token is the first maximum of its raw logits: greedy, no logprobs, nothing banned, no
    logits processor (a grammar, too, changes the logits: the caller checks for one). Then a model may pick
    without the logits (``greedy_head.py``); a new logits processor must make this False for the sequences it
    changes (``SamplingParams.has_logits_processors``)."""
    return all(
        s.params.greedy
        and s.params.logprobs is None
        and not s.banned_token_ids()
        and not s.params.has_logits_processors
        for s in seqs
    )


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``logits``: float32 ``[N, vocab]`` (modified in place)."""
        raw_logprobs = None
        if any(k is not None for k in batch.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        token_ids = self.sample(logits, batch).tolist()
        return SamplerOutput(token_ids, self.token_logprobs(raw_logprobs, batch, token_ids))

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The sampled ids, int64 ``[N]`` on the logits' device, without a wait for the device."""
        for row, token_ids in batch.banned:
            logits[row, token_ids] = float("-inf")
        if batch.grammar is not None:  # before temperature and every filter; logprobs are of the raw logits
            apply_grammar(logits, batch.grammar[1], batch.grammar[0])
        if batch.processors is not None:  # after the masks, as in vLLM (the min_tokens ban commutes with them)
            batch.processors.apply(logits)
        if batch.all_greedy:
            return greedy_tokens(logits)
        sampled = self._random(logits, batch)  # (leaves ``logits`` as they are)
        greedy_rows = batch.temperature == 0  # on the host: the argmax and its mask only where some row is greedy
        if bool(greedy_rows.any()):
            sampled = torch.where(host_to_device(greedy_rows, logits.device), greedy_tokens(logits), sampled)
        return sampled

    @staticmethod
    def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each row samples from, filtered in vLLM's order: temperature, then
        min-p, top-k and top-p (each on what the previous left, renormalized)."""
        device = logits.device
        temperature = host_to_device(batch.temperature, device)
        logits = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
        # Which filters apply is read from the host copies of the parameters: no wait for the device.
        min_p = host_to_device(batch.min_p, device)
        if bool((batch.min_p > 0).any()):
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        vocab = logits.shape[-1]
        top_k = host_to_device(batch.top_k, device)
        if bool((batch.top_k > 0).any()):
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
            k_max = int(torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab).max())
            kth = logits.topk(k_max, dim=-1).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = host_to_device(batch.top_p, device)
        if bool((batch.top_p < 1).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]  # keeps at least one
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(dim=-1)

    @classmethod
    def _random(cls, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = cls.probabilities(logits, batch)
        device, vocab = probs.device, probs.shape[-1]
        # Exponential race (Gumbel-max): argmax(p / q), q ~ Exp(1), drawn from each row's own
        # generator when it has a seed, so a seeded request samples the same whatever its batch.
        # q = -log(u) with u ~ U[0, 1): the same distribution as exponential_(), which is several
        # times slower on CPU.
        u = torch.empty_like(probs)
        unseeded = [row for row, g in enumerate(batch.generators) if g is None]
        if len(unseeded) == len(u):  # the same draws as filling those rows alone
            u.uniform_()
        elif unseeded:
            u[host_to_device(torch.tensor(unseeded), device)] = torch.empty(
                (len(unseeded), vocab), device=device
            ).uniform_()
        for row, g in enumerate(batch.generators):
            if g is None:
                continue
            if g.device.type == device.type:  # its own generator where the logits are (``Sequence.generator_on``)
                u[row].uniform_(generator=g)
            else:
                u[row] = host_to_device(torch.empty(vocab).uniform_(generator=g), device)
        return (probs / u.log_().neg_()).argmax(dim=-1)

    @staticmethod
    def token_logprobs(raw: torch.Tensor | None, batch: SamplingBatch, token_ids: list[int]) -> list[dict | None]:
        """Per row asking for ``k`` logprobs: the ``k`` most likely tokens and the sampled one,
        with ranks, from the log-softmax of the logits before any filtering (vLLM's default)."""
        if raw is None:
            return [None] * len(token_ids)
        top_vals, top_ids, chosen = Sampler.logprob_tensors(raw, batch, torch.tensor(token_ids, device=raw.device))
        top = (None, None) if top_vals is None else (top_vals.tolist(), top_ids.tolist())
        ranks = _LazyRanks(raw, chosen)
        return logprob_entries(batch.num_logprobs, *top, chosen.tolist(), token_ids, ranks)

    @staticmethod
    def logprob_tensors(
        raw: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """On the device, without a sync: the top ``max(k)`` logprobs and their ids of each row (None when no
        row asks for any), and each row's sampled token's logprob."""
        k_max = max(k or 0 for k in batch.num_logprobs)
        top_vals, top_ids = raw.topk(k_max, dim=-1) if k_max else (None, None)
        return top_vals, top_ids, raw.gather(1, token_ids[:, None])[:, 0]


class _LazyRanks:
    """A row's sampled token's rank, counted only when asked (the token is not among the row's top ``k``)."""

    def __init__(self, raw: torch.Tensor, chosen: torch.Tensor) -> None:
        self.raw, self.chosen = raw, chosen

    def __getitem__(self, row: int) -> int:
        return int((self.raw[row] > self.chosen[row]).sum()) + 1


def logprob_entries(
    num_logprobs: list[int | None],
    top_vals: list[list[float]] | None,
    top_ids: list[list[int]] | None,
    chosen: list[float],
    token_ids: list[int],
    ranks,
) -> list[dict | None]:
    """The host's logprob dicts from ``Sampler.logprob_tensors``' values: per row asking for ``k``, its top ``k``
    tokens (rank 1..k) and the sampled one (``ranks[row]``: its rank, asked only when it is not among them)."""
    out: list[dict | None] = []
    for row, k in enumerate(num_logprobs):
        if k is None:
            out.append(None)
            continue
        entry = {}
        if k:
            top = zip(top_ids[row][:k], top_vals[row][:k])
            entry = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(top, start=1)}
        if token_ids[row] not in entry:
            entry[token_ids[row]] = Logprob(chosen[row], ranks[row])
        out.append(entry)
    return out
