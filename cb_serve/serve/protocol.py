"""OpenAI-compatible request bodies (pydantic), their ranges, and their translation to
SamplingParams.

Ranges are checked here (pydantic: a 400 ``invalid_request_error`` naming the field) and by
the engine's input processor (engine-configured caps: stop strings, stop token ids,
logprobs). JSON types are strict, as OpenAI's: ``"stream": "yes"`` is a 400, not true (a number
may stand for a float, never a boolean for a number). OpenAI fields that would change the
result but are not implemented are declared so that ``unsupported()`` can name them (a 400
``unsupported``); unknown top-level fields are a 400 naming them (OpenAI's "Unrecognized request
argument"), so a field a client relies on is never dropped silently. Message objects ignore
fields they do not use (a client may send back a response message whole).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cb_serve import (
    SEED_MAX,
    SEED_MIN,
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from cb_serve.serve.request_parts import (
    MAX_TOOLS,
    CallsWriter,
    ChatMessage,
    NamedToolChoice,
    Strict,
    StructuredOutputs,
    ToolDefinition,
    tool_choice_constraint,
)

MAX_N = 16
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
MAX_LOGPROBS = 20
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


def _set(value: Any) -> bool:
    """Whether an optional field was given a value that asks for something (not null/empty/false)."""
    return value is not None and value != [] and value != {} and value is not False and value != ""


# vLLM extras that would change the output and are not implemented: declared to refuse them by name.
UNSUPPORTED_EXTRAS = {
    "use_beam_search": "beam search",
    "length_penalty": "beam search",
    "early_stopping": "beam search",
    "guided_json": "guided_json (use structured_outputs or response_format)",
    "guided_regex": "guided_regex (use structured_outputs)",
    "guided_choice": "guided_choice (use structured_outputs)",
    "guided_grammar": "guided_grammar (use structured_outputs)",
    "guided_decoding_backend": "guided_decoding_backend",
    "guided_whitespace_pattern": "guided_whitespace_pattern",
    "structural_tag": "structural tags",
    "logits_processors": "custom logits processors",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids",
    "cache_salt": "cache_salt",
    "kv_transfer_params": "KV transfer (disaggregated serving)",
    "vllm_xargs": "vllm_xargs",
    "mm_processor_kwargs": "multimodal inputs",
    "prompt_embeds": "prompt embeddings",
}


class _SamplingRequest(Strict):
    """Fields shared by completions and chat completions, plus vLLM's extras."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: completions with echo only
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: Annotated[int, Field(ge=-1)] = -1  # at least the vocabulary size: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None
    priority: Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)] = 0
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None  # keep the last k (-1: max_model_len)
    ignore_eos: bool = False
    return_timeline: bool = False  # cb-serve: the response carries the request's timeline (batch inspector)
    structured_outputs: StructuredOutputs | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: str | None = None  # vLLM's; the x-request-id header names requests here
    # Declared only to refuse them (see unsupported()).
    use_beam_search: bool = False
    length_penalty: Any = None
    early_stopping: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    prompt_embeds: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and any(not s for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and not all(k.isdigit() for k in v):
            raise ValueError("logit_bias keys must be token ids (non-negative integers, as strings)")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field that asks for something not implemented."""
        out = [(name, why) for name, why in UNSUPPORTED_EXTRAS.items() if _set(getattr(self, name))]
        if not self.spaces_between_special_tokens:
            out.append(("spaces_between_special_tokens", "spaces_between_special_tokens: false"))
        return out

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def constraint(self, write_calls: CallsWriter | None = None) -> StructuredOutputsParams | None:
        return self.structured_outputs.to_params() if self.structured_outputs is not None else None

    def to_sampling_params(
        self, default_max_tokens: int | None, max_tokens_cap: int | None, write_calls: CallsWriter | None = None
    ) -> SamplingParams:
        """Raises ``InvalidRequestError`` (a ValueError naming the parameter) when out of range. ``write_calls``:
        the grammar of forced calls in the model's tool-call format (``ToolCallParser.constraint``)."""
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = default_max_tokens
        if max_tokens_cap is not None and max_tokens is not None and max_tokens > max_tokens_cap:
            raise InvalidRequestError(
                f"max_tokens ({max_tokens}) exceeds this server's limit of {max_tokens_cap}.", "max_tokens"
            )
        if max_tokens == 0:
            raise InvalidRequestError("max_tokens must be at least 1 (0 only with echo, on /v1/completions).",
                                      "max_tokens")  # fmt: skip
        bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=self.constraint(write_calls),
        )


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_SamplingRequest):
    """``prompt``: a string, a list of token ids, or a list of either (one choice set per prompt)."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if len(v) == 0 or any(isinstance(p, (str, list)) and len(p) == 0 for p in v if not isinstance(v, str)):
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _best_of_at_least_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be at least n")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo (the prompt alone, with its logprobs)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, as a list (a single string or token list is one prompt)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt alone (one token is generated and dropped, as vLLM)."""
        return self.echo and self.max_tokens == 0

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.suffix:
            out.append(("suffix", "suffix (insertion)"))
        if self.best_of is not None and self.best_of > self.n:
            out.append(("best_of", "best_of greater than n"))
        return out

    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """With echo and logprobs, the prompt's tokens get logprobs too (vLLM: ``prompt_logprobs = logprobs``)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # The chat template's thinking switch (``thinking_kwargs``); a 400 for a template without one.
    reasoning_effort: Annotated[str, Field(max_length=32)] | None = None
    verbosity: str | None = None
    # vLLM's chat extras
    chat_template: str | None = None  # only where the server trusts request templates (RouterSettings)
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    include_reasoning: bool = True  # False: the reasoning is dropped from the response
    add_special_tokens: bool = False  # declared to refuse true: the template places special tokens
    echo: bool = False  # declared to refuse true
    documents: Any = None  # declared to refuse them
    # Accepted and ignored: they change nothing in the output.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant message")
        return self

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.response_format is not None and self.response_format.get("type", "text") not in RESPONSE_FORMATS:
            out.append(("response_format", "response formats other than text, json_object and json_schema"))
        if self.functions and self.function_call != "none":
            out.append(("functions", "function calling"))
        if self.modalities is not None and self.modalities != ["text"]:
            out.append(("modalities", "output modalities other than text"))
        for name in (
            "audio",
            "prediction",
            "web_search_options",
            "verbosity",
            "add_special_tokens",
            "echo",
            "documents",
        ):
            if _set(getattr(self, name)):
                out.append((name, name.replace("_", " ")))
        for i, message in enumerate(self.messages):
            why = message.unsupported()
            if why:
                out.append((f"messages.{i}", why))
        return out

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named`` (OpenAI's default: auto with tools)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (none for ``tool_choice: "none"``)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or ()] if self.tool_mode != "none" else None

    def tool_constraint(self, write_calls: CallsWriter | None = None) -> StructuredOutputsParams | None:
        """For ``required`` and named choices, the grammar of the calls; None otherwise."""
        choice, parallel = self.tool_choice, self.parallel_tool_calls
        return tool_choice_constraint(self.tools or [], choice, self.tool_mode, parallel, write_calls)

    def constraint(self, write_calls: CallsWriter | None = None) -> StructuredOutputsParams | None:
        """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM), not both; a required or
        named tool choice constrains the output to its calls."""
        tools = self.tool_constraint(write_calls)
        kind = (self.response_format or {}).get("type", "text")
        if tools is not None:
            if kind != "text" or self.structured_outputs is not None:
                raise InvalidRequestError("A required or named tool_choice cannot be combined with "
                                          "response_format or structured_outputs.", "tool_choice")  # fmt: skip
            return tools
        if kind == "text":
            return super().constraint()
        if self.structured_outputs is not None:
            raise InvalidRequestError("Give response_format or structured_outputs, not both.", "response_format")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        spec = self.response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequestError("response_format.json_schema must be an object with a schema.", "response_format")
        return StructuredOutputsParams(json=spec.get("schema", {}))


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
