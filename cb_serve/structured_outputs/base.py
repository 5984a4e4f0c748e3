"""The constraint backend interface: compile a constraint for a tokenizer, then per sequence a
matcher that fills its row of the step's token bitmask and follows the sampled tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from cb_serve.structured_outputs_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One sequence's position in its grammar. Not thread-safe; the engine drives it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask[row]`` (int32 words, bit ``t % 32`` of
        word ``t // 32`` set: token ``t`` allowed)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advances by a sampled token; False if the grammar does not allow it (an engine bug)."""

    @abstractmethod
    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar admits from here; changes nothing
        (speculative decoding: a refused token must not be fed to ``accept_token``)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens (speculative decoding)."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more: the sequence stops."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (jump-forward)."""


class CompiledGrammar(ABC):
    """A constraint compiled for one tokenizer; makes any number of matchers."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher: ...


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer. ``compile`` may take long: call it off the
    engine's step thread (``GrammarCompiler`` does)."""

    name: str

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Tokens a bitmask row covers."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Raises ``InvalidRequestError`` naming the problem for a constraint it cannot compile."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed (every bit set)."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Sets the logits of disallowed tokens to -inf in place: ``bitmask`` row ``i`` masks
    ``logits`` row ``rows[i]`` (row ``i`` when ``rows`` is None); the rows not named are untouched."""
    if rows is not None and not rows:
        return
    vocab = logits.shape[-1]
    words = bitmask if rows is None else bitmask[: len(rows)]
    allowed = ((words[:, :, None] >> _BITS.to(words.device)) & 1).reshape(words.shape[0], -1)[:, :vocab]
    allowed = allowed.to(logits.device, non_blocking=True).bool()
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
