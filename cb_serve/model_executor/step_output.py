"""What a step gives back: ``StepResult`` on the host, and for a step launched ahead under async scheduling
(vLLM's ``AsyncModelRunnerOutput``, SGLang's overlap scheduler) ``AsyncStepOutput``, whose sampled ids stay
on the device for the next step's inputs and come to the host (``copy_to_host``: pinned memory, no wait)
while the next step is scheduled and launched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cb_serve.model_executor.sampler import logprob_entries
from cb_serve.sequence import Sequence
from cb_serve.stats import ExpertLoad


class DraftVerifier(Protocol):
    """Speculative decoding's verification (``Speculator.verify``): a speculating sequence's
    emitted tokens and their logprobs from its ``1 + k`` logits rows, under its grammar's masks."""

    def __call__(
        self, seq: Sequence, logits: torch.Tensor, grammar: torch.Tensor | None
    ) -> tuple[list[int], list[dict | None]]: ...


@dataclass
class ForwardOutput:
    """A step's forward pass as sampling reads it: the sampling rows' final hidden states, or from a decode
    graph (which runs the final norm, LM head and argmax as well) their logits and greedy ids; and the
    prompt-logprob rows' hidden states (None: none)."""

    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    greedy: torch.Tensor | None = None  # each row's first maximum of ``logits``
    prompt_hidden: torch.Tensor | None = None

    @property
    def samples(self) -> bool:
        return self.hidden is not None or self.logits is not None


@dataclass
class StepResult:
    """Per sampling sequence (in batch order), the tokens it emits and their logprobs (None: not
    asked): the sampled token, or for a sequence that verified drafts its accepted drafts and the
    target's token. ``prepare_s``: the wall seconds spent building the batch."""

    sampling_seqs: list[Sequence] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict | None]] = field(default_factory=list)
    prepare_s: float = 0.0
    prompt_logprobs: list[tuple[Sequence, list[dict]]] = field(default_factory=list)  # new entries per sequence
    expert_load: ExpertLoad | None = None  # a mixture-of-experts model's routing (``record_expert_load``)


def copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """``tensors`` on their way to pinned host memory without a wait, and the CUDA event behind the copies
    (None on the CPU: the tensors themselves). The pinned blocks come from PyTorch's caching host allocator,
    which reuses a block only once the copy recorded on it has run: a ring the allocator keeps."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


@dataclass
class HostLogprobs:
    """A launched step's logprobs (``Sampler.logprob_tensors`` with every row's rank), copied to the host with
    its ids."""

    num_logprobs: list[int | None]
    tensors: list[torch.Tensor]  # [top values, top ids] (when a row asks for any), chosen logprobs, ranks

    def entries(self, token_ids: list[int]) -> list[dict | None]:
        """Once their copy has run (the ids' event: one behind every copy of the step)."""
        *top, chosen, ranks = (t.tolist() for t in self.tensors)
        return logprob_entries(self.num_logprobs, *(top or (None, None)), chosen, token_ids, ranks)


@dataclass
class AsyncStepOutput:
    """A launched step: its sampling sequences (batch order) and their sampled ids on their way to the host.
    ``result()`` waits for that copy alone, never for a later step."""

    sampling_seqs: list[Sequence]
    host_ids: torch.Tensor
    copied: Any  # torch.cuda.Event, or None
    prepare_s: float
    expert_load: tuple[tuple[int, ...], torch.Tensor] | None = None  # MoE routing, still on the device
    logprobs: HostLogprobs | None = None

    def result(self) -> StepResult:
        if self.copied is not None:
            self.copied.synchronize()
        ids = self.host_ids.tolist()
        entries = [None] * len(ids) if self.logprobs is None else self.logprobs.entries(ids)
        out = StepResult(self.sampling_seqs, [[t] for t in ids], [[e] for e in entries], self.prepare_s)
        if self.expert_load is not None:
            layer_ids, load = self.expert_load
            out.expert_load = ExpertLoad(layer_ids, load.cpu().numpy())
        return out
