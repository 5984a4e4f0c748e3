"""Chat templating: a conversation (messages, tools, the request's template options) to the prompt's token
ids, exactly as ``LLM.chat`` and the HTTP front end render it (``apply_chat_template``), and the front
end's tokenizer (``PromptEncoder``: loads only the tokenizer, tokenizes once, sends ids to the engine).

Chat messages carry images as content parts (``split_images``): OpenAI's ``image_url`` (``{"url": ...}`` or
the URL itself), the Responses API's ``input_image`` and, offline, vLLM's ``image_pil`` and ``image`` parts
holding a PIL image or bytes. Each becomes ``{"type": "image"}``, the part multimodal chat templates render as
the model's placeholder (Gemma 3: ``<start_of_image>``), and the images come back in message order, for the
model's processor (``multimodal.image_prompts``).
Every option a client sends is checked here (``InvalidRequestError``, naming the field)."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from cb_serve.config import EngineConfig
from cb_serve.engine.processor import encode_text
from cb_serve.errors import InvalidRequestError
from cb_serve.model_executor import loader
from cb_serve.tool_format import render_builtin, template_supports_tools

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
IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image")  # content parts that carry an image
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


def image_of(part: Mapping[str, Any]) -> Any:
    """The image a content part carries (a URL string, bytes or a PIL image); None for other parts."""
    kind = part.get("type")
    if kind not in IMAGE_PART_TYPES:
        return None
    value = part.get("image_url") if kind in ("image_url", "input_image") else part.get(kind, part.get("url"))
    if isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise InvalidRequestError(f"A content part of type {kind!r} carries no image.", "messages")
    return value


def split_images(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the chat template, with each image part ``{"type": "image"}``; the images, in order)."""
    rendered: list[dict[str, Any]] = []
    images: list[Any] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(isinstance(p, Mapping) and image_of(p) is not None
                                                    for p in content):  # fmt: skip
            rendered.append(dict(message))
            continue
        parts = []
        for part in content:
            image = image_of(part) if isinstance(part, Mapping) else None
            if image is not None:
                images.append(image)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, images


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
    tokenize: bool = True,
) -> Any:
    """Token ids of a conversation rendered with the model's chat template (or the request's
    ``chat_template``: whether a client may send one is the caller's call). With ``tools``, or
    tool calls and results in the history, a template that does not render tools gets the
    conversation in the built-in tool format (``tool_format.render_builtin``).
    ``chat_template_kwargs`` go to the template (``check_template_kwargs``), with what
    ``reasoning_effort`` maps to (``thinking_kwargs``); ``continue_final_message`` leaves the last
    (assistant) message open for the model to go on, instead of a generation prompt (as vLLM).
    ``tokenize=False``: the rendered text instead (a conversation with images, which the model's processor
    tokenizes with them: ``multimodal.image_prompts``)."""
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
            messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
        )
    except Exception as e:  # template errors (bad roles, order) are the caller's input
        if chat_template is not None and type(e).__name__ == "TemplateSyntaxError":
            raise InvalidRequestError(f"chat_template is not a valid Jinja template: {e}", "chat_template") from e
        raise InvalidRequestError(f"The chat template rejected the messages: {e}", "messages") from e
    if not tokenize:
        return ids
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
    ) -> Any:
        """``apply_chat_template`` with this tokenizer (token ids; the text with ``tokenize=False``);
        ``options``: its keyword-only arguments."""
        with self._lock:
            return apply_chat_template(self.tokenizer, messages, add_generation_prompt, tools, **options)
