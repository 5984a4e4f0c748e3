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

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cb_serve import (
    SEED_MAX,
    SEED_MIN,
    ConstraintLimits,
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    tool_call_constraint,
)

MAX_N = 16
MAX_TOOLS = 128  # OpenAI's limit
TOOL_LIMITS = ConstraintLimits()  # each tool's parameters schema, and all of them together
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
MAX_LOGPROBS = 20
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class Strict(BaseModel):
    """JSON types as OpenAI takes them, and no field it does not know."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs`` extra: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


def _set(value: Any) -> bool:
    """Whether an optional field was given a value that asks for something (not null/empty/false)."""
    return value is not None and value != [] and value != {} and value is not False and value != ""


class _SamplingRequest(Strict):
    """Fields shared by completions and chat completions, plus vLLM's extras."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: Annotated[int, Field(ge=-1)] = -1  # at least the vocabulary size: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    return_timeline: bool = False  # cb-serve: the response carries the request's timeline (batch inspector)
    structured_outputs: StructuredOutputs | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Declared only to refuse them (see unsupported()).
    repetition_penalty: float | None = None
    use_beam_search: bool = False
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    prompt_logprobs: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and any(not s for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field that asks for something not implemented."""
        out = []
        if self.presence_penalty or self.frequency_penalty:
            out.append(("presence_penalty" if self.presence_penalty else "frequency_penalty", "penalties"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias"))
        if self.repetition_penalty not in (None, 1.0):
            out.append(("repetition_penalty", "repetition_penalty"))
        for name in ("use_beam_search", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if _set(getattr(self, name)):
                out.append((name, "beam search and guided decoding"))
        if self.prompt_logprobs is not None:
            out.append(("prompt_logprobs", "prompt logprobs"))
        return out

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def constraint(self) -> StructuredOutputsParams | None:
        return self.structured_outputs.to_params() if self.structured_outputs is not None else None

    def to_sampling_params(self, default_max_tokens: int | None, max_tokens_cap: int | None) -> SamplingParams:
        """Raises ``InvalidRequestError`` (a ValueError naming the parameter) when out of range."""
        max_tokens = self.requested_max_tokens() or default_max_tokens
        if max_tokens_cap is not None and max_tokens is not None and max_tokens > max_tokens_cap:
            raise InvalidRequestError(
                f"max_tokens ({max_tokens}) exceeds this server's limit of {max_tokens_cap}.", "max_tokens"
            )
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
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=self.constraint(),
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[Annotated[int, Field(ge=0)]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _best_of_at_least_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be at least n")
        return self

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion)"))
        if self.best_of is not None and self.best_of > self.n:
            out.append(("best_of", "best_of greater than n"))
        return out

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_parts_have_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs text")
        return self


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always fit the schema when a call is enforced


class ToolDefinition(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            ok = isinstance(json.loads(v), dict)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("function.arguments must be a JSON object, as text")
        return v

    def parsed(self) -> dict[str, Any]:
        return json.loads(self.arguments)


class ToolCall(BaseModel):
    """A call in an assistant message of the history (as a response gave it)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_template(self) -> dict[str, Any]:
        function = {"name": self.function.name, "arguments": self.function.parsed()}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(BaseModel):
    """OpenAI's message schema: ``content`` is required except for an assistant message that
    carries ``tool_calls``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError(f"content is required in a {self.role} message")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def unsupported(self) -> str | None:
        if self.role == "function" or self.function_call:
            return "function calling (the deprecated form: use tools)"
        if isinstance(self.content, list) and any(p.type != "text" for p in self.content):
            return "content parts other than text"
        return None

    def to_template(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content or [])
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:  # arguments as objects: what chat templates render
            message["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


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
    reasoning_effort: str | None = None  # refused when set: cb-serve's models do not reason
    verbosity: str | None = None
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
        return self

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.response_format is not None and self.response_format.get("type", "text") not in RESPONSE_FORMATS:
            out.append(("response_format", "response formats other than text, json_object and json_schema"))
        if self.functions and self.function_call != "none":
            out.append(("functions", "function calling"))
        if self.modalities is not None and self.modalities != ["text"]:
            out.append(("modalities", "output modalities other than text"))
        for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"):
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

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """For ``required`` and named choices, the grammar of the calls; None otherwise."""
        mode = self.tool_mode
        if mode == "none" and self.tool_choice not in (None, "none"):
            raise InvalidRequestError(f"tool_choice {self._choice_name()} needs tools.", "tool_choice")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools: function names must be unique.", "tools")
        for tool in self.tools or ():
            _check_tool_schema(tool.function.parameters)
        if mode not in ("required", "named"):
            return None
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        chosen = [t for t in self.tools or () if named is None or t.function.name == named]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names {self._choice_name()}, which is not in tools.", "tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in chosen]
        constraint = tool_call_constraint(tools, parallel=mode == "required" and self.parallel_tool_calls is not False)
        cap = TOOL_LIMITS.max_grammar_chars
        if len(constraint.grammar or "") > cap:
            raise InvalidRequestError(f"tools: the chosen tools' schemas together exceed {cap} characters.", "tools")
        return constraint

    def _choice_name(self) -> str:
        choice = self.tool_choice
        return repr(choice.function.name if isinstance(choice, NamedToolChoice) else choice)[:80]

    def constraint(self) -> StructuredOutputsParams | None:
        """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM), not both; a required or
        named tool choice constrains the output to its calls."""
        tools = self.tool_constraint()
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


def _check_tool_schema(parameters: dict[str, Any] | None) -> None:
    """A tool's ``parameters`` within the constraint caps (400 naming ``tools`` if not)."""
    if parameters is None:
        return
    if parameters.get("type", "object") != "object":
        raise InvalidRequestError("tools: a function's parameters must be an object schema.", "tools")
    try:
        StructuredOutputsParams(json=parameters).check(TOOL_LIMITS)
    except InvalidRequestError as e:
        message = str(e).replace("structured_outputs: the schema", "tools: a parameters schema")
        raise InvalidRequestError(message, "tools") from None


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
