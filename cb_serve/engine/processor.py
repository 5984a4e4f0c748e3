"""Validates and tokenizes requests before anything is scheduled."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any

from cb_serve.config import EngineConfig
from cb_serve.errors import InvalidRequestError
from cb_serve.inputs import PromptType, multi_modal_data, multi_modal_features, parse_prompt
from cb_serve.lora_request import LoRARequest
from cb_serve.multimodal.features import MultiModalFeature
from cb_serve.multimodal.image_inputs import ImageLimits
from cb_serve.multimodal.image_prompts import ImagePrompts
from cb_serve.multimodal.processor import make_processor
from cb_serve.sampling_params import SamplingParams, tokenize_bad_words
from cb_serve.structured_outputs_params import ConstraintLimits

CONSTRAINT_LIMITS = ConstraintLimits()  # what a client's constraint must fit before it is compiled


@dataclass
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # with the tokenizer's EOS ids filled in
    max_tokens: int
    lora_request: LoRARequest | None = None
    lora_weights: Any = None  # the adapter read off the engine thread (``LoRAManager.read``), if it was
    priority: int = 0  # scheduling_policy "priority": lower first
    arrival_time: float = field(default_factory=time.monotonic)  # when the front end took it in
    mm_features: tuple[MultiModalFeature, ...] = ()  # its images, in prompt order


class InputProcessor:
    """Pure function of (prompt, params): safe to call from any thread. Everything a request
    brings is range-checked here, before the engine thread sees it (``InvalidRequestError``,
    naming the parameter)."""

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        config: EngineConfig,
        mm_processor=None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.config = config
        # Where images are served (``mm_processor``: the model's ``multimodal.processor.MultiModalProcessor``)
        self.images = None if mm_processor is None else ImagePrompts(
            mm_processor, ImageLimits.of(config), config.max_num_batched_tokens)  # fmt: skip

    def with_tokenizer(self, tokenizer) -> InputProcessor:
        """The same checks with another tokenizer instance (tokenizers are not thread-safe)."""
        other = copy.copy(self)
        other.tokenizer = tokenizer
        return other

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedRequest:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}.")
        text, token_ids = parse_prompt(prompt)
        features: tuple[MultiModalFeature, ...] = ()
        if (images := multi_modal_data(prompt)) is not None:
            token_ids, features = self.image_prompts().process(text, images)
        elif (processed := multi_modal_features(prompt)) is not None:
            features = self.image_prompts("multi_modal_features").check(token_ids, processed)
        if token_ids is None:
            token_ids = encode_text(self.tokenizer, text)
        else:
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)]
            if bad:
                raise InvalidRequestError(f"Prompt token ids must be integers, got {bad[0]!r}.", "prompt")
            out_of_vocab = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if out_of_vocab:
                raise InvalidRequestError(
                    f"Prompt token id {out_of_vocab[0]} is out of vocabulary (valid: 0..{self.vocab_size - 1}).",
                    "prompt",
                )
        if not token_ids:
            raise InvalidRequestError("The prompt is empty.", "prompt")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"The prompt has {n} tokens; this model's maximum context length (max_model_len) is "
                f"{self.max_model_len}, which must also leave room for at least one generated token.",
                "prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{n + max_tokens} ({n} in the prompt, {max_tokens} in the completion). Lower max_tokens "
                f"or shorten the prompt.",
                "max_tokens",
            )
        self._check_limits(params)
        top_k = -1 if params.top_k >= self.vocab_size else params.top_k
        bad_words = tokenize_bad_words(self.tokenizer, params.bad_words, self.vocab_size) if params.bad_words else ()
        params = replace(params, eos_token_ids=self.eos_token_ids, top_k=top_k, bad_words_token_ids=bad_words)
        return ProcessedRequest(text, token_ids, params, max_tokens, mm_features=features)

    def image_prompts(self, param: str = "multi_modal_data") -> ImagePrompts:
        """The model's image path; an ``InvalidRequestError`` where it reads none."""
        if self.images is None:
            raise InvalidRequestError(
                "This model does not read images (a text model, or limit_mm_per_prompt sets images to 0).", param
            )
        return self.images

    def _check_limits(self, params: SamplingParams) -> None:
        c = self.config
        if len(params.stop) > c.max_stop_strings:
            raise InvalidRequestError(f"At most {c.max_stop_strings} stop strings are allowed.", "stop")
        if any(len(s) > c.max_stop_string_len for s in params.stop):
            raise InvalidRequestError(f"Stop strings are limited to {c.max_stop_string_len} characters.", "stop")
        if len(params.stop_token_ids) > c.max_stop_token_ids:
            raise InvalidRequestError(f"At most {c.max_stop_token_ids} stop_token_ids are allowed.", "stop_token_ids")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids {bad_stop[:8]} are out of vocabulary.", "stop_token_ids")
        if params.structured_outputs is not None:
            params.structured_outputs.check(CONSTRAINT_LIMITS)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > c.max_logprobs:
                raise InvalidRequestError(f"{name} is limited to {c.max_logprobs}, got {k}.", name)
        token_ids = {"logit_bias": params.logit_bias or (), "allowed_token_ids": params.allowed_token_ids or ()}
        for name, ids in token_ids.items():
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} token ids {bad[:8]} are out of vocabulary (valid: 0..{self.vocab_size - 1}).", name
                )


def image_prompts_for(config: EngineConfig) -> ImagePrompts | None:
    """The image path of the model ``config`` names, for a front end that processes images before an engine
    takes them (the HTTP router: ``multi_modal_features``); None where the engine serves text alone."""
    from cb_serve.model_executor import loader, model_setup

    source = loader.resolve_model_source(config.model)
    mm_config = model_setup.multimodal_config(config, source)
    if mm_config is None:
        return None
    processor = make_processor(source.path, mm_config, config.trust_remote_code)
    return ImagePrompts(processor, ImageLimits.of(config), config.max_num_batched_tokens)


def encode_text(tokenizer, prompt: str) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS)."""
    if not prompt:
        raise InvalidRequestError("The prompt is empty.", "prompt")
    return tokenizer.encode(prompt, add_special_tokens=True)
