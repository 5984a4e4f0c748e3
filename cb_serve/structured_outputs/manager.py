"""``StructuredOutputManager``: the one owner of structured outputs in the engine step (vLLM v1's
manager of the same name, beside the scheduler).

It joins the step at these named places, and nowhere else:
- ``admit``: requests wait here, holding no running slot and no KV block, while their grammar
  compiles on the compiler's thread; those whose grammar is ready go to the scheduler, each
  sequence with its own matcher;
- ``valid_drafts``: the speculator keeps only the drafts a sequence's grammar admits;
- ``grammar_bitmask``: the masks of every constrained sampling position of the step, draft
  positions included, filled on the filler thread while the forward pass runs;
- ``accept_token`` and ``forced_tokens`` (jump-forward): the output processor's, per emitted token.

With a reasoning parser (a think-tag one, or Harmony's, which gpt-oss's template brings), a sequence's
grammar waits for its reasoning to end (vLLM's ``should_fill_bitmask``/``should_advance``): until then its
matcher is held here, not on the sequence (``seq.matcher`` is None), so the step treats it as unconstrained
(no mask, no jump-forward, drafts kept up to the end marker, min_tokens bans as usual). The reasoning ends
where ``ReasoningParser.reasoning_ended`` says: at admission when the prompt's last think tag is
``</think>``, else where the output's last tokens are the end marker (``end_ids``: ``</think>``, or
Harmony's ``<|channel|>final<|message|>``). The marker is not fed to the grammar (vLLM: the grammar starts
after it); the next token is the grammar's first. Checked once per token. A constraint with
``enable_in_reasoning`` (a grammar that writes the whole turn, as Harmony's forced tool calls do) applies
from the first token.

``fill_rows`` is the only code that asks a matcher for its mask: sampling, draft verification and
jump-forward all read masks it produced.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import Protocol

import torch

from cb_serve.errors import EngineOverloadedError, InvalidRequestError
from cb_serve.sequence import SchedulerOutput, Sequence
from cb_serve.stats import StructuredOutputStats
from cb_serve.structured_outputs.base import GrammarMatcher, allocate_bitmask
from cb_serve.structured_outputs.compiler import GrammarCompiler
from cb_serve.structured_outputs_params import PARAM, ConstraintLimits, StructuredOutputsParams

logger = logging.getLogger(__name__)
MAX_WAIT_FACTOR = 6  # a request waits at most this many compile timeouts for its grammar, queue included


def fill_rows(matcher: GrammarMatcher, drafts: list[int], bitmask: torch.Tensor, row: int) -> None:
    """Rows ``row .. row + len(drafts)`` of ``bitmask``: the grammar's mask before each draft and
    after the last (the matcher is stepped through the drafts, which it admits, and rolled back)."""
    matcher.fill_bitmask(bitmask, row)
    for i, token in enumerate(drafts, 1):
        assert matcher.accept_token(token), "a draft the grammar refuses was kept"
        matcher.fill_bitmask(bitmask, row + i)
    if drafts:
        matcher.rollback(len(drafts))


class GrammarBitmask:
    """One step's masks, being filled on the filler thread: ``masks()`` (taken once, after the
    forward pass) maps each constrained sampling sequence's ``seq_id`` to its ``[1 + k, words]``
    rows (a row that failed to fill admits everything: its request fails when it accepts)."""

    def __init__(self, future: concurrent.futures.Future, num_seqs: int) -> None:
        self._future = future
        self.num_seqs = num_seqs
        self.fill_s = self.wait_s = 0.0

    def masks(self) -> dict[int | str, torch.Tensor]:
        waited = time.perf_counter()
        masks, self.fill_s = self._future.result()
        self.wait_s = time.perf_counter() - waited
        return masks


def _fill(
    constrained: list[tuple[Sequence, list[int]]], vocab_size: int
) -> tuple[dict[int | str, torch.Tensor], float]:
    start = time.perf_counter()
    bitmask = allocate_bitmask(sum(1 + len(d) for _, d in constrained), vocab_size)
    out, row = {}, 0
    for seq, drafts in constrained:
        try:
            fill_rows(seq.matcher, drafts, bitmask, row)
        except Exception:  # noqa: BLE001 - those rows stay unmasked; the request fails when it accepts
            logger.exception("filling a grammar bitmask failed")
            bitmask[row : row + 1 + len(drafts)] = -1
        out[seq.seq_id] = bitmask[row : row + 1 + len(drafts)]
        row += 1 + len(drafts)
    return out, time.perf_counter() - start


def _llguidance_backend(tokenizer, vocab_size: int):
    from cb_serve.structured_outputs.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size)


class ReasoningEnd(Protocol):
    """What the manager needs of a reasoning parser (``cb_serve.reasoning.ReasoningParser``,
    ``HarmonyReasoningEnd``): the tokens that end the reasoning, and where an output starts."""

    @property
    def end_ids(self) -> tuple[int, ...]: ...

    def starts_in_reasoning(self, prompt_token_ids: Tokens[int]) -> bool: ...


@dataclass
class _Waiting:
    seqs: list[Sequence]
    future: concurrent.futures.Future
    key: str
    added: float


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        enable_jump_forward: bool = False,
        limits: ConstraintLimits | None = None,
        reasoning: ReasoningEnd | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.reasoning = reasoning  # grammars apply after the reasoning ends (None: from the first token)
        self._end_ids: tuple[int, ...] = tuple(reasoning.end_ids) if reasoning is not None else ()
        # sequences still reasoning -> their matcher, not yet applied (weak: a finished sequence just goes)
        self._reasoning_seqs: weakref.WeakKeyDictionary[Sequence, GrammarMatcher] = weakref.WeakKeyDictionary()
        self.enable_jump_forward = enable_jump_forward
        self.limits = limits or ConstraintLimits()
        self._make_backend = functools.partial(_llguidance_backend, tokenizer, vocab_size)
        self._compiler: GrammarCompiler | None = None  # made on the first constrained request
        self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cb-serve-bitmask")
        self._scratch = allocate_bitmask(1, vocab_size)  # jump-forward's one row (engine thread)
        self.waiting: dict[str, _Waiting] = {}  # request id -> its sequences while their grammar compiles
        self._refused: set[str] = set()  # refused by ``admit``, until the engine ends them (``drop``)
        self._step = StructuredOutputStats()  # since the last take_stats
        self._bitmask: GrammarBitmask | None = None  # the current step's
        self.num_constrained_requests = 0  # cumulative
        self.jump_forward_tokens = 0  # cumulative

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._make_backend)
        return self._compiler

    # ---- admission ------------------------------------------------------------------
    def add_request(self, request_id: str, constraint: StructuredOutputsParams, seqs: list[Sequence]) -> None:
        """Starts compiling the request's grammar; ``admit`` hands its sequences over once it is ready."""
        future = self.compiler.submit(constraint)
        self.waiting[request_id] = _Waiting(seqs, future, constraint.key(), time.monotonic())
        self.num_constrained_requests += 1
        self._step.num_constrained_requests += 1

    def drop(self, request_id: str) -> bool:
        """Forgets a request it holds (waiting for its grammar, or refused by ``admit`` and not yet
        ended): whether it held it, i.e. the request was never scheduled and holds no KV block."""
        held = self.waiting.pop(request_id, None) is not None
        if request_id in self._refused:
            self._refused.remove(request_id)
            held = True
        return held

    def admit(self) -> tuple[list[Sequence], list[tuple[str, Exception]]]:
        """The sequences whose grammar is ready (each with its matcher), and the requests refused:
        their constraint did not compile, or not within ``compile_timeout_s`` of compiling (the
        backend's one-off setup and the wait behind other compiles do not count); the engine ends
        each refused one (``drop`` then says it was never scheduled)."""
        ready: list[Sequence] = []
        refused: list[tuple[str, Exception]] = []
        now = time.monotonic()
        for request_id, w in list(self.waiting.items()):
            if not w.future.done():
                error = self._overdue(w.key, w.added, now)
                if error is not None:
                    del self.waiting[request_id]
                    refused.append((request_id, error))
                continue
            del self.waiting[request_id]
            error = w.future.exception()
            if error is not None:
                if not isinstance(error, InvalidRequestError):
                    logger.error("compiling the constraint of request %s failed", request_id, exc_info=error)
                    error = InvalidRequestError(f"{PARAM}: the constraint could not be compiled.", PARAM)
                refused.append((request_id, error))
                continue
            compiled = w.future.result()
            for seq in w.seqs:
                self._start_grammar(seq, compiled.matcher())
                ready.append(seq)
        self._refused.update(request_id for request_id, _ in refused)
        return ready, refused

    def _start_grammar(self, seq: Sequence, matcher: GrammarMatcher) -> None:
        """Gives ``seq`` its matcher now, or holds it while the output starts inside the reasoning."""
        constraint = seq.params.structured_outputs
        in_reasoning = constraint is not None and constraint.enable_in_reasoning
        if self.reasoning is not None and not in_reasoning and self.reasoning.starts_in_reasoning(seq.prompt_token_ids):
            self._reasoning_seqs[seq] = matcher
        else:
            seq.matcher = matcher

    def is_reasoning(self, seq: Sequence) -> bool:
        """``seq`` has a grammar that waits for the end of its reasoning."""
        return seq in self._reasoning_seqs

    def _overdue(self, key: str, added: float, now: float) -> Exception | None:
        """A 400 when the request's own compile ran over ``compile_timeout_s``; a 503 (retry) when
        it waited ``MAX_WAIT_FACTOR`` times that behind other compiles."""
        timeout = self.limits.compile_timeout_s
        since = self.compiler.compiling_since(key)
        if since is not None and now > max(since, added) + timeout:
            return InvalidRequestError(f"{PARAM}: compiling took over {timeout} s.", PARAM)
        if now > added + MAX_WAIT_FACTOR * timeout:
            return EngineOverloadedError("The grammar compiler is busy with other requests' constraints; retry.")
        return None

    def waiting_seqs(self) -> Iterator[Sequence]:
        """The sequences of the requests waiting for their grammar."""
        return (seq for w in self.waiting.values() for seq in w.seqs)

    def wait(self, timeout_s: float) -> None:
        """Blocks until a waiting grammar is ready, at most ``timeout_s`` (none waiting: returns)."""
        futures = [w.future for w in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- the step -------------------------------------------------------------------
    def valid_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts ``seq``'s grammar admits, up to the first it refuses or the one that would
        end it (the grammar's end is the target's to emit); the matcher is rolled back. While its
        reasoning goes on: the drafts before a ``</think>`` (the target emits that token itself, as
        the step's last: the token after it is the grammar's, sampled under its mask next step)."""
        matcher = seq.matcher
        if matcher is None:
            return drafts[: max(0, self._before_end(seq, drafts))] if seq in self._reasoning_seqs else drafts
        if not drafts:
            return drafts
        consumed = 0
        for token in drafts[: matcher.valid_prefix(drafts)]:  # each admitted, so accepting it is safe
            assert matcher.accept_token(token)
            consumed += 1
            if matcher.is_terminated:
                break
        keep = consumed - matcher.is_terminated
        if consumed:
            matcher.rollback(consumed)
        return drafts[:keep]

    def grammar_bitmask(self, sched: SchedulerOutput) -> GrammarBitmask | None:
        """Starts filling the masks of the step's constrained sequences that sample (each at its
        ``1 + k`` positions with ``k`` drafts); None when there are none."""
        constrained = [
            (seq, list(seq.spec_token_ids))
            for seq, n in zip(sched.seqs, sched.num_scheduled_tokens)
            if seq.matcher is not None and n == seq.num_uncomputed_tokens + len(seq.spec_token_ids)
        ]
        self._bitmask = None
        if constrained:
            future = self._filler.submit(_fill, constrained, self.vocab_size)
            self._bitmask = GrammarBitmask(future, len(constrained))
        return self._bitmask

    def accept_token(self, seq: Sequence, token_id: int) -> bool:
        """Advances ``seq``'s grammar past an emitted token: whether the grammar is now complete
        (the sequence stops). Raises when the grammar refuses a token its mask allowed. The token
        that ends a sequence's reasoning starts its grammar, from the next token on."""
        matcher = seq.matcher
        if matcher is None:
            if seq in self._reasoning_seqs and self._before_end(seq, []) == -1:  # it ended: the grammar is next
                seq.matcher = self._reasoning_seqs.pop(seq)
            return False
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its mask allowed")
        return matcher.is_terminated

    def _before_end(self, seq: Sequence, drafts: list[int]) -> int:
        """How many of ``drafts`` come before the one that would complete the reasoning's end marker after
        ``seq``'s tokens (all of them: none does); -1 when its output already ends with it. The completing token
        is an output token or a draft; the marker's first tokens may be the prompt's last."""
        n, end = len(self._end_ids), self._end_ids
        start = max(0, seq.num_tokens - n)
        window = seq.token_ids[start:] + drafts
        here = seq.num_tokens - start  # where the drafts begin in the window
        for stop in range(here, len(window) + 1):
            completes_in_output = start + stop - 1 >= seq.num_prompt_tokens
            if stop >= n and completes_in_output and tuple(window[stop - n : stop]) == end:
                return stop - here - 1
        return len(drafts)

    def forced_tokens(self, seq: Sequence, limit: int) -> Iterator[int]:
        """Jump-forward: the tokens ``seq``'s grammar forces next, at most ``limit``, each yielded
        once the mask at its position admits it and nothing else (so decoding under the mask could
        have produced no other token there: no retokenization is involved). The caller appends each
        with ``accept_token`` before taking the next. A request asking for logprobs gets none
        (forced tokens have no logprobs of their own)."""
        matcher = seq.matcher
        if not self.enable_jump_forward or matcher is None or seq.params.logprobs is not None or limit <= 0:
            return
        for token_id in matcher.forced_tokens()[:limit]:
            if not self._only_choice(matcher, token_id):
                return
            self.jump_forward_tokens += 1
            self._step.jump_forward_tokens += 1
            yield token_id

    def _only_choice(self, matcher: GrammarMatcher, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size:
            return False
        fill_rows(matcher, [], self._scratch, 0)
        word, bit = divmod(token_id, 32)
        expected = torch.zeros_like(self._scratch[0])
        expected[word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)  # bit 31: a negative int32
        return bool(torch.equal(self._scratch[0], expected))

    def take_stats(self) -> StructuredOutputStats:
        """This step's: its masks (what the forward pass did not hide of their fill), and since the
        previous call the completed compiles, constrained requests added and forced tokens."""
        stats, self._step = self._step, StructuredOutputStats()
        b = self._bitmask
        if b is not None:
            stats.num_constrained_seqs, stats.grammar_fill_s, stats.grammar_wait_s = b.num_seqs, b.fill_s, b.wait_s
        self._bitmask = None
        if self._compiler is not None:
            stats.grammar_compile_s = self._compiler.drain_compile_times()
        return stats
