"""Parts of the request bodies: the messages and tools of a chat request (OpenAI's schema), as
``ChatCompletionRequest`` takes them and the chat template renders them, and vLLM's
``structured_outputs``. Message objects ignore fields they do not use (a client
may send back a response message whole)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from cb_serve import ConstraintLimits, InvalidRequestError, StructuredOutputsParams, tool_call_constraint

MAX_TOOLS = 128  # OpenAI's limit
TOOL_LIMITS = ConstraintLimits()  # each tool's parameters schema, and all of them together


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
    enable_in_reasoning: bool | None = None

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
            enable_in_reasoning=bool(self.enable_in_reasoning),
        )


# Why audio and file inputs are refused (a 400 naming the part): no audio encoder is served. Images are
# served where the model reads them (``image_url`` parts; a text model answers them with a 400).
NO_MEDIA_INPUT = "no audio or file input; images only where the model reads them"
IMAGE_PART = "image_url"


def media_parts_refused(kinds: list[str]) -> str | None:
    """What ``unsupported()`` names for content parts of types ``kinds`` (none: None)."""
    kinds = sorted(set(kinds))
    return f"content parts of type {', '.join(kinds)} ({NO_MEDIA_INPUT})" if kinds else None


class ImageURL(BaseModel):
    """OpenAI's ``image_url`` object: a ``data:`` URL, or http(s) where the server allows its domain."""

    model_config = ConfigDict(strict=True, extra="ignore")

    url: str
    detail: Literal["auto", "low", "high"] | None = None  # the processor's own resolution applies


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None  # ``type: image_url`` (vLLM also takes the URL itself)

    @model_validator(mode="after")
    def _parts_have_payloads(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs text")
        if self.type == IMAGE_PART and self.image_url is None:
            raise ValueError("an image_url content part needs image_url")
        return self

    def to_template(self) -> dict[str, Any]:
        if self.type == IMAGE_PART:
            url = self.image_url.url if isinstance(self.image_url, ImageURL) else self.image_url
            return {"type": IMAGE_PART, IMAGE_PART: {"url": url}}
        return {"type": "text", "text": self.text or ""}


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


def _json_object_text(v: str) -> str:
    try:
        ok = isinstance(json.loads(v), dict)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError("arguments must be a JSON object, as text")
    return v


JsonObjectText = Annotated[str, AfterValidator(_json_object_text)]  # a tool call's arguments


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: JsonObjectText

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
        if isinstance(self.content, list):
            return media_parts_refused([p.type for p in self.content if p.type not in ("text", IMAGE_PART)])
        return None

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text parts joined, unless it has images (``image_url``
        parts, which ``multimodal.image_prompts.split_images`` takes out)."""
        parts = self.content if isinstance(self.content, list) else []
        if any(p.type == IMAGE_PART for p in parts):
            content: Any = [p.to_template() for p in parts if p.type in ("text", IMAGE_PART)]
        else:
            content = self.content if isinstance(self.content, str) else "".join(p.text or "" for p in parts)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:  # arguments as objects: what chat templates render
            message["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


def check_tool_schema(parameters: dict[str, Any] | None) -> None:
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


CallsWriter = Callable[[list[dict[str, Any]], bool], StructuredOutputsParams]  # (tools, parallel) -> grammar


def tool_choice_constraint(
    tools: list[ToolDefinition],
    choice: Any,
    mode: str,
    parallel_tool_calls: bool | None,
    write_calls: CallsWriter | None = None,
) -> StructuredOutputsParams | None:
    """Checks the tools (unique names, schemas within the caps); for ``required`` and ``named``
    tool choices (``mode``), the grammar of the calls, in the model's format (``write_calls``; Hermes
    blocks by default); None otherwise."""
    name = repr(choice.function.name if isinstance(choice, NamedToolChoice) else choice)[:80]
    if mode == "none" and choice not in (None, "none"):
        raise InvalidRequestError(f"tool_choice {name} needs tools.", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique.", "tools")
    for tool in tools:
        check_tool_schema(tool.function.parameters)
    if mode not in ("required", "named"):
        return None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    chosen = [t for t in tools if named is None or t.function.name == named]
    if not chosen:
        raise InvalidRequestError(f"tool_choice names {name}, which is not in tools.", "tool_choice")
    dumped = [t.model_dump(exclude_none=True) for t in chosen]
    constraint = (write_calls or tool_call_constraint)(dumped, mode == "required" and parallel_tool_calls is not False)
    cap = TOOL_LIMITS.max_grammar_chars
    if len(constraint.grammar or "") > cap:
        raise InvalidRequestError(f"tools: the chosen tools' schemas together exceed {cap} characters.", "tools")
    return constraint
