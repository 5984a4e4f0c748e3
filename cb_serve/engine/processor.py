"""Validates and tokenizes requests before anything is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cb_serve.sampling_params import SamplingParams

PromptType = str | list[int]


@dataclass
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # with the tokenizer's EOS ids filled in
    max_tokens: int


class InputProcessor:
    """Pure function of (prompt, params): safe to call from any thread."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedRequest:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt is empty.")
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)]
            if bad:
                raise ValueError(f"Prompt token ids must be integers, got {bad[0]!r}.")
            out_of_vocab = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if out_of_vocab:
                raise ValueError(
                    f"Prompt token id {out_of_vocab[0]} is out of vocabulary (valid: 0..{self.vocab_size - 1})."
                )
        else:
            raise TypeError(f"A prompt is a string or a list of token ids, got {type(prompt).__name__}.")
        if not token_ids:
            raise ValueError("The prompt is empty.")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"The prompt has {n} tokens; this model's maximum context length (max_model_len) is "
                f"{self.max_model_len}, which must also leave room for at least one generated token."
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{n + max_tokens} ({n} in the prompt, {max_tokens} in the completion). Lower max_tokens "
                f"or shorten the prompt."
            )
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} are out of vocabulary.")
        return ProcessedRequest(text, token_ids, replace(params, eos_token_ids=self.eos_token_ids), max_tokens)


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template."""
    if not messages:
        raise ValueError("messages is empty.")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("This model's tokenizer has no chat template.")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as e:  # template errors (bad roles, order) are the caller's input
        raise ValueError(f"The chat template rejected the messages: {e}") from e
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
