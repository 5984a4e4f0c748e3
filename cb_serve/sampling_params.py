"""Per-request sampling parameters (vLLM-compatible names and defaults)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any

from cb_serve.errors import InvalidRequestError
from cb_serve.structured_outputs_params import StructuredOutputsParams

# torch.Generator.manual_seed takes [-2**63, 2**64 - 1].
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# Below this temperature sampling is greedy (as in vLLM): dividing logits by it overflows.
MIN_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI, vLLM)
MAX_LOGIT_BIAS = 100.0  # each bias is clamped to [-100, 100] (OpenAI, vLLM)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # above any vocabulary
MAX_BAD_WORDS = 128  # token sequences after tokenization (vLLM's VLLM_MAX_NUM_BAD_WORDS)
MAX_BAD_WORDS_TOKENS = 1024  # their tokens together (vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text / tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one prompt.

    ``temperature == 0`` (or below 1e-5) means greedy. ``top_k`` of 0 or -1 (or at least the
    vocabulary size) and ``top_p == 1`` disable those filters. ``logprobs=k`` returns the top-k log-probabilities
    (of the raw model distribution) for each generated token, plus the sampled one.

    Logits processors (vLLM's, applied in its order before temperature: ``model_executor.logits_processors``):
    ``allowed_token_ids`` keeps only those tokens; ``bad_words`` bans the last token of a word whose other tokens
    end the output; ``logit_bias`` adds a bias (clamped to [-100, 100]) per token id; ``repetition_penalty``
    divides positive (multiplies other) logits of every token seen in the prompt or the output, then
    ``frequency_penalty`` times its count and ``presence_penalty`` are subtracted for each output token.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # top-k log-probabilities of each prompt token
    # Filled in by the engine from the tokenizer; not user knobs.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # The logits processors' per-request tensors, built on first use (``logits_processors.RequestTensors``).
    _processor_tensors: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))  # vLLM drops repeats
        self._validate()
        self._validate_processors()
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.logit_bias is not None:
            self.logit_bias = {
                t: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(b))) for t, b in self.logit_bias.items()
            }

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        check(is_int(self.n) and self.n >= 1, "n", f"n must be at least 1, got {self.n}.")
        temperature_ok = is_real(self.temperature) and self.temperature >= 0.0
        check(temperature_ok, "temperature", f"temperature must be a non-negative number, got {self.temperature}.")
        check(is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        top_k_ok = is_int(self.top_k) and self.top_k >= -1
        check(top_k_ok, "top_k", f"top_k must be -1 (disable) or a positive integer, got {self.top_k}.")
        check(is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        seed_ok = self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX)
        check(seed_ok, "seed", f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}.")
        max_ok = self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1)
        check(max_ok, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        min_ok = is_int(self.min_tokens) and self.min_tokens >= 0
        check(min_ok, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}.")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
        )
        logprobs_ok = self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0)
        check(logprobs_ok, "logprobs", f"logprobs must be a non-negative integer, got {self.logprobs}.")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings.")
        ids_ok = all(is_int(t) and t >= 0 for t in self.stop_token_ids)
        check(ids_ok, "stop_token_ids", "stop_token_ids must be non-negative integers.")
        so_ok = self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams)
        check(so_ok, "structured_outputs", "structured_outputs must be a StructuredOutputsParams.")
        prompt_ok = self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0)
        check(
            prompt_ok, "prompt_logprobs", f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs}."
        )

    def _validate_processors(self) -> None:
        """The logits processors' parameters (token ids against the vocabulary: ``InputProcessor``)."""

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param)

        def is_real(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def is_id(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            ok = is_real(value) and -MAX_PENALTY <= value <= MAX_PENALTY
            check(ok, name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}.")
        rep = self.repetition_penalty
        check(
            is_real(rep) and rep > 0, "repetition_penalty", f"repetition_penalty must be a positive number, got {rep}."
        )
        bias = self.logit_bias
        if bias is not None:
            check(isinstance(bias, dict), "logit_bias", "logit_bias must map token ids to biases.")
            check(
                len(bias) <= MAX_LOGIT_BIAS_ENTRIES,
                "logit_bias",
                f"logit_bias has at most {MAX_LOGIT_BIAS_ENTRIES} entries.",
            )
            check(all(is_id(t) for t in bias), "logit_bias", "logit_bias keys must be non-negative integer token ids.")
            check(all(is_real(b) for b in bias.values()), "logit_bias", "logit_bias values must be finite numbers.")
        allowed = self.allowed_token_ids
        if allowed is not None:
            check(isinstance(allowed, list) and len(allowed) > 0, "allowed_token_ids", "allowed_token_ids is empty.")
            check(len(allowed) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids", "allowed_token_ids is too long.")
            check(
                all(is_id(t) for t in allowed), "allowed_token_ids", "allowed_token_ids must be non-negative integers."
            )
        words = self.bad_words
        if words is not None:
            check(all(isinstance(w, str) and w for w in words), "bad_words", "bad_words must be non-empty strings.")
            check(len(words) <= MAX_BAD_WORDS, "bad_words", f"At most {MAX_BAD_WORDS} bad_words are allowed.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logits_processors(self) -> bool:
        """A logits processor may change this request's logits (so its greedy pick too)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words_token_ids
        )

    @property
    def needs_host_each_step(self) -> bool:
        """The host must see each sampled token (or its logits) before the next step is prepared: a grammar's
        mask, prompt logprobs, and bad words of more than one token (whether the output ends in a word's first
        tokens). Async scheduling runs the steps of such a request synchronously (logprobs come back with the
        sampled ids). ``min_tokens`` needs the output's length alone, and the penalties take the step in
        flight's token on the device (``logits_processors.Penalties``): they run ahead."""
        return bool(
            self.structured_outputs is not None
            or self.prompt_logprobs is not None
            or any(len(word) > 1 for word in self.bad_words_token_ids)
        )

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of parallel sample ``index`` of an ``n > 1`` request."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > SEED_MAX:
            seed -= 1 << 64  # torch maps a negative seed s to 2**64 - 1 + s
        return replace(self, n=1, seed=seed)


def tokenize_bad_words(tokenizer, bad_words: list[str], vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token sequences ``bad_words`` ban, as vLLM's ``SamplingParams.update_from_tokenizer``: each word
    (left-stripped) encoded without special tokens, and again after a space where that gives another first
    token and as many tokens (the word inside a sentence)."""
    if tokenizer is None:
        raise InvalidRequestError("bad_words need the model's tokenizer.", "bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InvalidRequestError(f"bad word {word!r} has no tokens.", "bad_words")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS or sum(map(len, sequences)) > MAX_BAD_WORDS_TOKENS:
        raise InvalidRequestError(
            f"bad_words tokenize to {len(sequences)} sequences of {sum(map(len, sequences))} tokens; at most "
            f"{MAX_BAD_WORDS} sequences of {MAX_BAD_WORDS_TOKENS} tokens in all are allowed.",
            "bad_words",
        )
    if any(not 0 <= t < vocab_size for seq in sequences for t in seq):
        raise InvalidRequestError(f"bad_words tokenize to ids outside the vocabulary (size {vocab_size}).", "bad_words")
    return tuple(sequences)
