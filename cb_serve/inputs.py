"""Prompt forms, as vLLM takes them: a string, a list of token ids, ``TextPrompt``
(``{"prompt": ...}``) or ``TokensPrompt`` (``{"prompt_token_ids": [...]}``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from typing_extensions import NotRequired

from cb_serve.errors import InvalidRequestError


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, if known (kept in the output)


PromptType = str | list[int] | TextPrompt | TokensPrompt
# Keys of vLLM's prompt dicts for features this engine does not have: refused, never ignored.
UNSUPPORTED_KEYS = ("mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds", "cache_salt")
# ``multi_modal_features``: images a front end already ran through the model's processor (the HTTP router's
# ``MultiModalFeature``s), beside the token ids they expanded; checked against those ids.
KNOWN_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_features", *UNSUPPORTED_KEYS)


def parse_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt: ids are None when the text must be tokenized. Raises
    ``TypeError`` for what is not a prompt, ``InvalidRequestError`` for a dict this engine cannot serve."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    if isinstance(prompt, Mapping):
        unsupported = [k for k in prompt if k in UNSUPPORTED_KEYS]
        unknown = [k for k in prompt if k not in KNOWN_KEYS]
        if unsupported or unknown:
            what = "unsupported" if unsupported else "unknown"
            raise InvalidRequestError(f"The prompt has {what} fields {unsupported or unknown}.", "prompt")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f'"prompt" is a string, got {type(text).__name__}.')
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise TypeError(f'"prompt_token_ids" is a list of token ids, got {type(ids).__name__}.')
            return text, list(ids)
        if text is None:
            raise InvalidRequestError(
                'A prompt dict needs "prompt" (TextPrompt) or "prompt_token_ids" (TokensPrompt).', "prompt"
            )
        return text, None
    raise TypeError(
        f"A prompt is a string, a list of token ids, a TextPrompt or a TokensPrompt dict, got {type(prompt).__name__}."
    )


def multi_modal_data(prompt: Any) -> Any:
    """A prompt dict's images (vLLM's ``{"prompt": ..., "multi_modal_data": {"image": ...}}``), else None."""
    if not isinstance(prompt, Mapping) or prompt.get("multi_modal_data") is None:
        return None
    data = prompt["multi_modal_data"]
    if not isinstance(data, Mapping) or set(data) != {"image"}:
        what = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise InvalidRequestError(f'multi_modal_data takes {{"image": ...}} (images only), got {what}.', "prompt")
    if "prompt" not in prompt or "prompt_token_ids" in prompt:
        raise InvalidRequestError('A prompt with images is a text prompt ("prompt" with its placeholders).', "prompt")
    return data["image"]


def multi_modal_features(prompt: Any) -> Any:
    """A token prompt's processed images (``multi_modal_features``), else None."""
    if not isinstance(prompt, Mapping) or prompt.get("multi_modal_features") is None:
        return None
    if "prompt_token_ids" not in prompt or prompt.get("multi_modal_data") is not None:
        raise InvalidRequestError("multi_modal_features go with the prompt_token_ids they expanded.", "prompt")
    return prompt["multi_modal_features"]


def carries_images(prompt: Any) -> bool:
    """Whether a prompt dict brings images (raw or processed): its processing decodes or hashes them."""
    return isinstance(prompt, Mapping) and any(
        prompt.get(key) is not None for key in ("multi_modal_data", "multi_modal_features")
    )


def is_single_prompt(prompts: Any) -> bool:
    """True for one prompt, False for a sequence of prompts (vLLM's rule: a list of ints is one
    prompt's token ids; an empty list is no prompts)."""
    if isinstance(prompts, (str, Mapping)):
        return True
    return isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
