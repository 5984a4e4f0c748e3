"""The draft-model proposer (``speculative_config`` method ``draft_model``): a small model with the
target's tokenizer drafts greedily, ``k`` tokens for all the sequences that speculate in ``k``
batched steps of its own, with its own paged KV cache.

Each target sequence has a shadow ``Sequence`` here: the same tokens, but its own block table and
``num_computed_tokens`` in the draft's block pool. Before drafting, a shadow catches up with its
target: its tokens past the longest common prefix (its rejected drafts) are replaced by the
target's, and its computed count falls back to that prefix (their KV is overwritten later, as the
target's is). The first of the ``k`` passes computes all a shadow lacks (its whole prompt, the
first time) under one token budget; a sequence whose chunk the budget cuts drafts nothing this
step and goes on from there the next. A greedy draft is a one-hot proposal, so sampled requests verify it by
rejection sampling exactly as an n-gram draft.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Protocol

from cb_serve.config import EngineConfig
from cb_serve.model_executor import loader
from cb_serve.model_executor.device_context import device_context
from cb_serve.model_executor.model_runner import ModelRunner
from cb_serve.model_executor.model_setup import ModelSetup
from cb_serve.sampling_params import SamplingParams
from cb_serve.sequence import SchedulerOutput, Sequence, SequenceStatus
from cb_serve.spec_decode.proposer import DraftProposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class BlockPool(Protocol):
    """What the proposer needs of a block manager (``engine.block_manager.BlockManager``)."""

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool: ...
    def free(self, seq: Sequence) -> None: ...


class DraftModel:
    """The draft's weights on the target's device, with the target's dtype, block size and context
    length; loaded beside the target before the KV caches are sized (they share the memory)."""

    def __init__(self, setup: ModelSetup) -> None:
        self.setup = setup
        self.model = None

    @classmethod
    def for_target(cls, config: EngineConfig, target: ModelSetup, draft_model: str, tokenizer) -> DraftModel:
        """Raises ``ValueError`` unless ``draft_model`` has the target's vocabulary and tokenizer."""
        draft_config = dataclasses.replace(
            config,
            model=draft_model,
            speculative_config=None,
            tensor_parallel_size=1,  # the driver alone drafts
            block_size=target.block_size,
            max_model_len=target.max_model_len,
            limit_mm_per_prompt={"image": 0},  # a draft reads token ids alone (its vision tower is not loaded)
        )
        setup = ModelSetup.from_config(draft_config, target.device)
        if setup.kv_layout.state_layers:
            raise ValueError(
                f"The draft model ({setup.hf_config.model_type}) has recurrent layers, whose states a draft cannot "
                "take back; speculative_config.model must be an attention-only model of the target's tokenizer."
            )
        if setup.hf_config.vocab_size != target.hf_config.vocab_size:
            raise ValueError(
                f"The draft model's vocabulary ({setup.hf_config.vocab_size}) differs from the target's "
                f"({target.hf_config.vocab_size}): speculative_config.model must share the target's tokenizer."
            )
        if config.tokenizer is None:
            try:
                own = loader.load_tokenizer(setup.source, None, config.trust_remote_code)
            except ValueError:
                own = None  # weights only: the vocabulary size is all there is to compare
            if own is not None and own.get_vocab() != tokenizer.get_vocab():
                raise ValueError("speculative_config.model must share the target's tokenizer; its vocabulary differs.")
        return cls(setup)

    def load(self) -> None:
        self.model = self.setup.load_model()

    def runner(self, num_blocks: int) -> ModelRunner:
        s = self.setup
        return ModelRunner(self.model, num_blocks, s.block_size, s.kv_cache_dtype, s.device, kv_layout=s.kv_layout)


def common_prefix(a: list[int], b: list[int], start: int) -> int:
    """The length of the common prefix of ``a`` and ``b``, given they agree up to ``start``."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Shadow:
    seq: Sequence  # the draft's copy of a target sequence: its tokens, block table and computed count
    synced: int = 0  # tokens known equal to the target's at the last sync


class ShadowProposer(DraftProposer):
    """A proposer with a model of its own (``runner``) and, per target sequence, a shadow ``Sequence`` in its own
    block pool (``shadows``, by ``id()`` of the target sequence; each with ``.seq``)."""

    proposes_for_free = False  # forward passes of its own: the policy chooses k before drafting

    def __init__(self, runner: ModelRunner, blocks: BlockPool) -> None:
        self.runner = runner
        self.blocks = blocks
        self.shadows: dict[int, Any] = {}

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(id(seq), None)
        if shadow is not None:
            self.blocks.free(shadow.seq)
            self.runner.release(shadow.seq)


class DraftModelProposer(ShadowProposer):
    def __init__(self, runner: ModelRunner, blocks: BlockPool, max_num_batched_tokens: int) -> None:
        super().__init__(runner, blocks)
        self.max_num_batched_tokens = max_num_batched_tokens
        self._ids = itertools.count()

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        with device_context(self.runner.device):  # the draft's passes launch kernels on the engine's device
            return self._propose(seqs, num_drafts)

    def _propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        shadows = [self._synced(seq) for seq in seqs]
        budget = self.max_num_batched_tokens  # the first pass computes what each shadow lacks
        rows, chunks = [], []
        for i, shadow in enumerate(shadows):
            if num_drafts[i] == 0:
                continue
            chunk = min(shadow.num_uncomputed_tokens, budget)
            if chunk and self.blocks.allocate(shadow, chunk):
                rows.append(i)
                chunks.append(chunk)
                budget -= chunk
        while rows:
            sampled = self._run([shadows[i] for i in rows], chunks)
            for i, chunk in zip(rows, chunks):
                shadows[i].num_computed_tokens += chunk
                token = sampled.get(id(shadows[i]))
                if token is not None:  # None: a catch-up chunk the budget cut short
                    shadows[i].token_ids.append(token)  # its KV is computed by the next pass, if any
                    drafts[i].append(token)
            rows = [i for i in rows if 0 < len(drafts[i]) < num_drafts[i] and self.blocks.allocate(shadows[i], 1)]
            chunks = [1] * len(rows)
        return drafts

    def _synced(self, seq: Sequence) -> Sequence:
        """``seq``'s shadow, its tokens made the target's (its rejected drafts dropped)."""
        shadow = self.shadows.get(id(seq))
        if shadow is None:
            draft_seq = Sequence(next(self._ids), "draft", 0, seq.token_ids, GREEDY, 1)
            draft_seq.status = SequenceStatus.RUNNING
            shadow = self.shadows[id(seq)] = Shadow(draft_seq)
        tokens = shadow.seq.token_ids
        same = common_prefix(tokens, seq.token_ids, shadow.synced)
        del tokens[same:]
        tokens.extend(seq.token_ids[same:])
        # At most all but the newest token: the draft may already hold it (a draft the scheduler cut
        # that the target then picked itself), but the next draft is sampled from its position.
        shadow.seq.num_computed_tokens = min(shadow.seq.num_computed_tokens, same, seq.num_tokens - 1)
        shadow.synced = seq.num_tokens
        return shadow.seq

    def _run(self, seqs: list[Sequence], num_tokens: list[int]) -> dict[int, int]:
        """One forward pass of the draft over ``seqs``' next ``num_tokens``: the greedy next token
        of each that reaches its last token, by ``id()`` (the runner reorders rows)."""
        sched = SchedulerOutput()
        sched.seqs.extend(seqs)
        sched.num_scheduled_tokens.extend(num_tokens)
        result = self.runner.execute(sched)
        return {id(seq): tokens[0] for seq, tokens in zip(result.sampling_seqs, result.token_ids)}
