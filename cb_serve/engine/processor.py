"""Validates and tokenizes requests before anything is scheduled."""

from __future__ import annotations

import copy
import re
import threading
from dataclasses import dataclass, replace
from typing import Any

from cb_serve.config import EngineConfig
from cb_serve.errors import InvalidRequestError
from cb_serve.inputs import PromptType, parse_prompt
from cb_serve.lora_request import LoRARequest
from cb_serve.model_executor import loader
from cb_serve.sampling_params import SamplingParams, tokenize_bad_words
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
    priority: int = 0  # scheduling_policy "priority": lower first


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
        bad_words = tokenize_bad_words(self.tokenizer, params.bad_words, self.vocab_size) if params.bad_words else ()
        params = replace(params, eos_token_ids=self.eos_token_ids, top_k=top_k, bad_words_token_ids=bad_words)
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


def encode_text(tokenizer, prompt: str) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS)."""
    if not prompt:
        raise InvalidRequestError("The prompt is empty.", "prompt")
    return tokenizer.encode(prompt, add_special_tokens=True)


# What a request's chat_template_kwargs may not name: ``apply_chat_template``'s own arguments and
# what HF's renderer sets beside them (vLLM refuses ``chat_template`` and ``tokenize``; all are refused here).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        *("messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt"),
        *("continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length"),
        *("return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"),
        *("raise_exception", "strftime_now"),
    }
)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's; the first two turn thinking off
MAX_KWARGS_DEPTH = 16


def _json_like(value: Any, depth: int = 0) -> bool:
    if depth > MAX_KWARGS_DEPTH:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_like(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v, depth + 1) for k, v in value.items())
    return False


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` (vLLM's field) as the template gets them: string keys,
    JSON-like values, no key that overrides the call's own arguments (``InvalidRequestError``)."""
    param = "chat_template_kwargs"
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object.", param)
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise InvalidRequestError(f"chat_template_kwargs keys must be strings, got {key!r}.", param)
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"chat_template_kwargs may not set {key!r} (an argument of the call).", param)
        if not _json_like(value):
            raise InvalidRequestError(f"chat_template_kwargs[{key!r}] must be a JSON value.", param)
    return dict(kwargs)


def _template_text(tokenizer, chat_template: str | None) -> str:
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return "\n".join(template.values()) if isinstance(template, dict) else template or ""


def template_reads(template: str, name: str) -> bool:
    """Whether a Jinja template mentions the variable ``name`` (what it may be given)."""
    return re.search(rf"\b{re.escape(name)}\b", template) is not None


def thinking_kwargs(tokenizer, reasoning_effort: str | None, chat_template: str | None = None) -> dict[str, Any]:
    """The template kwargs for a request's ``reasoning_effort``: passed as is to a template that
    reads ``reasoning_effort``; else mapped to a Qwen3-style ``enable_thinking`` switch ("none" and
    "minimal": off; "low", "medium", "high": on); a template with neither is a 400."""
    if reasoning_effort is None:
        return {}
    if reasoning_effort not in REASONING_EFFORTS:
        raise InvalidRequestError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}.", "reasoning_effort")
    template = _template_text(tokenizer, chat_template)
    if template_reads(template, "reasoning_effort"):
        return {"reasoning_effort": reasoning_effort}
    if template_reads(template, "enable_thinking"):
        return {"enable_thinking": reasoning_effort not in ("none", "minimal")}
    raise InvalidRequestError(
        "reasoning_effort is not supported by this model: its chat template has no thinking switch "
        "(it reads neither enable_thinking nor reasoning_effort).",
        "reasoning_effort",
    )


def _render_kwargs(
    tokenizer, chat_template: str | None, chat_template_kwargs: Any, reasoning_effort: str | None
) -> dict[str, Any]:
    """chat_template_kwargs checked, with what reasoning_effort maps to (a conflict is a 400)."""
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise InvalidRequestError("chat_template must be a non-empty Jinja template.", "chat_template")
    kwargs = check_template_kwargs(chat_template_kwargs)
    for key, value in thinking_kwargs(tokenizer, reasoning_effort, chat_template).items():
        if key in kwargs and kwargs[key] != value:
            raise InvalidRequestError(
                f"reasoning_effort conflicts with chat_template_kwargs[{key!r}].", "reasoning_effort"
            )
        kwargs[key] = value
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return kwargs


def _check_continuation(messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> None:
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true.", "continue_final_message"
        )
    if messages[-1].get("role") != "assistant":
        raise InvalidRequestError("continue_final_message needs an assistant message last.", "continue_final_message")


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    *,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    reasoning_effort: str | None = None,
) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template (or the request's
    ``chat_template``: whether a client may send one is the caller's call). With ``tools``, or
    tool calls and results in the history, a template that does not render tools gets the
    conversation in the built-in tool format (``tool_format.render_builtin``).
    ``chat_template_kwargs`` go to the template (``check_template_kwargs``), with what
    ``reasoning_effort`` maps to (``thinking_kwargs``); ``continue_final_message`` leaves the last
    (assistant) message open for the model to go on, instead of a generation prompt (as vLLM)."""
    if not messages:
        raise InvalidRequestError("messages is empty.", "messages")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "This model has no chat template (a base model): send a plain prompt to /v1/completions "
            "(offline: LLM.generate) instead of messages.",
            "messages",
        )
    _check_continuation(messages, add_generation_prompt, continue_final_message)
    kwargs = _render_kwargs(tokenizer, chat_template, chat_template_kwargs, reasoning_effort)
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        if template_supports_tools(tokenizer) if chat_template is None else "tools" in chat_template:
            kwargs["tools"] = tools or None
        else:
            messages = render_builtin(messages, tools)
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
    except Exception as e:  # template errors (bad roles, order) are the caller's input
        if chat_template is not None and type(e).__name__ == "TemplateSyntaxError":
            raise InvalidRequestError(f"chat_template is not a valid Jinja template: {e}", "chat_template") from e
        raise InvalidRequestError(f"The chat template rejected the messages: {e}", "messages") from e
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class PromptEncoder:
    """Turns prompts and conversations into token ids exactly as the engine does, for a front end
    that tokenizes once and sends ids (the HTTP router). Loads only the tokenizer; thread-safe."""

    def __init__(self, config: EngineConfig) -> None:
        source = loader.resolve_model_source(config.model)
        self.tokenizer = loader.load_tokenizer(source, config.tokenizer, config.trust_remote_code)
        self._lock = threading.Lock()  # HF tokenizers are not thread-safe

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            if not add_special_tokens:
                return self.tokenizer.encode(prompt, add_special_tokens=False)
            return encode_text(self.tokenizer, prompt)

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens kept); an id out of the vocabulary is an
        ``InvalidRequestError``."""
        with self._lock:
            if any(t >= len(self.tokenizer) for t in token_ids):
                raise InvalidRequestError(f"Token ids must be below {len(self.tokenizer)}.", "tokens")
            return self.tokenizer.decode(token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        with self._lock:
            return self.tokenizer.convert_ids_to_tokens(token_ids)

    def with_tokenizer(self, use: Any) -> Any:
        """``use(tokenizer)`` under the tokenizer's lock."""
        with self._lock:
            return use(self.tokenizer)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **options: Any
    ) -> list[int]:
        """``apply_chat_template`` with this tokenizer; ``options``: its keyword-only arguments."""
        with self._lock:
            return apply_chat_template(self.tokenizer, messages, add_generation_prompt, tools, **options)
