"""Validates and tokenizes requests before anything is scheduled."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, replace
from typing import Any

from cb_serve.config import EngineConfig
from cb_serve.errors import InvalidRequestError
from cb_serve.inputs import PromptType, parse_prompt
from cb_serve.lora_request import LoRARequest
from cb_serve.model_executor import loader
from cb_serve.sampling_params import SamplingParams
from cb_serve.structured_outputs_params import ConstraintLimits
from cb_serve.tool_format import render_builtin, template_supports_tools

CONSTRAINT_LIMITS = ConstraintLimits()  # what a client's constraint must fit before it is compiled


@dataclass
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # with the tokenizer's EOS ids filled in
    max_tokens: int
    lora_request: LoRARequest | None = None
    lora_weights: Any = None  # the adapter read off the engine thread (``LoRAManager.read``), if it was


class InputProcessor:
    """Pure function of (prompt, params): safe to call from any thread. Everything a request
    brings is range-checked here, before the engine thread sees it (``InvalidRequestError``,
    naming the parameter)."""

    def __init__(
        self, tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: frozenset[int], config: EngineConfig
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.config = config

    def with_tokenizer(self, tokenizer) -> InputProcessor:
        """The same checks with another tokenizer instance (tokenizers are not thread-safe)."""
        other = copy.copy(self)
        other.tokenizer = tokenizer
        return other

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedRequest:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}.")
        text, token_ids = parse_prompt(prompt)
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
        params = replace(params, eos_token_ids=self.eos_token_ids, top_k=top_k)
        return ProcessedRequest(text, token_ids, params, max_tokens)

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
        if params.logprobs is not None and params.logprobs > c.max_logprobs:
            raise InvalidRequestError(f"logprobs is limited to {c.max_logprobs}, got {params.logprobs}.", "logprobs")


def encode_text(tokenizer, prompt: str) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS)."""
    if not prompt:
        raise InvalidRequestError("The prompt is empty.", "prompt")
    return tokenizer.encode(prompt, add_special_tokens=True)


def apply_chat_template(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template. With ``tools``, or
    tool calls and results in the history, a template that does not render tools gets the
    conversation in the built-in tool format (``tool_format.render_builtin``)."""
    if not messages:
        raise InvalidRequestError("messages is empty.", "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "This model has no chat template (a base model): send a plain prompt to /v1/completions "
            "(offline: LLM.generate) instead of messages.",
            "messages",
        )
    kwargs = {}
    if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        if template_supports_tools(tokenizer):
            kwargs["tools"] = tools or None
        else:
            messages = render_builtin(messages, tools)
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
    except Exception as e:  # template errors (bad roles, order) are the caller's input
        raise InvalidRequestError(f"The chat template rejected the messages: {e}", "messages") from e
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class PromptEncoder:
    """Turns prompts and conversations into token ids exactly as the engine does, for a front end
    that tokenizes once and sends ids (the HTTP router). Loads only the tokenizer; thread-safe."""

    def __init__(self, config: EngineConfig) -> None:
        source = loader.resolve_model_source(config.model)
        self.tokenizer = loader.load_tokenizer(source, config.tokenizer, config.trust_remote_code)
        self._lock = threading.Lock()  # HF tokenizers are not thread-safe

    def encode(self, prompt: str) -> list[int]:
        with self._lock:
            return encode_text(self.tokenizer, prompt)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        with self._lock:
            return apply_chat_template(self.tokenizer, messages, add_generation_prompt, tools)
