"""Anthropic Messages API request bodies (pydantic), as ``anthropic.types.message_create_params``
and ``message_count_tokens_params`` spell them.

Top-level fields are strict (exact JSON types, unknown fields a 400 naming them). Content blocks
ignore fields they do not use (``cache_control``, ``citations``, ``caller``: a client may send a
response's blocks back whole). Blocks and tools this server cannot serve (documents, images in tool
results, server tools) validate as ``OtherBlock`` / ``ServerTool`` so that ``unsupported()`` can name
where they are, rather than failing as an unknown shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from cb_serve.serve.request_parts import NO_MEDIA_INPUT

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # what chat's FunctionDefinition takes
KNOWN_BLOCKS = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
BLOCKS_SERVED = f"content blocks other than text, image, tool_use, tool_result ({NO_MEDIA_INPUT})"


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Block(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(Block):
    type: Literal["text"]
    text: str


class Base64Source(Block):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(Block):
    type: Literal["url"]
    url: str


class ImageBlock(Block):
    """An image in a user turn: base64 data, or a URL (fetched only where the server allows its domain)."""

    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def url(self) -> str:
        """As an OpenAI ``image_url``: a data URL for base64 data."""
        source = self.source
        return source.url if isinstance(source, URLSource) else f"data:{source.media_type};base64,{source.data}"


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class OtherBlock(BaseModel):
    """Any other block (document, search_result, server tool blocks; an image in a tool result): refused by name."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str


def _tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in KNOWN_BLOCKS else "other"


def _result_tag(value: Any) -> str | None:
    kind = _tag(value)
    return kind if kind in (None, "text") else "other"  # tool results carry text alone


ResultPart = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_result_tag),
]


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool = False


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_tag),
]


class Message(BaseModel):
    """One turn. ``system`` turns are in the client's types (``SystemMessageParam``): text only."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ClientTool(Strict):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None  # accepted, ignored: prefix caching is automatic
    input_examples: list[dict[str, Any]] | None = None  # refused when set (see unsupported())


class ServerTool(BaseModel):
    """A tool Anthropic runs (``web_search_20250305``, ``bash_20250124``, ...): refused by name."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "client" if kind in (None, "custom") else "server"


Tool = Annotated[
    Annotated[ClientTool, Tag("client")] | Annotated[ServerTool, Tag("server")],
    Discriminator(_tool_tag),
]


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice.name is required with type "tool", and only with it')
        return self


class Thinking(Strict):
    """``enabled`` (with ``budget_tokens``, at least 1024 as Anthropic's), ``adaptive`` or ``disabled``."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None
    display: Literal["summarized", "omitted"] | None = None  # accepted, ignored: reasoning is sent whole

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('thinking.budget_tokens is required with type "enabled", and only with it')
        return self


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(Strict):
    user_id: str | None = None


class ConversationRequest(Strict):
    """What a Messages request and a count_tokens request share: the prompt and its tools."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # accepted, ignored: prefix caching is automatic
    speed: Literal["standard", "fast"] | None = None  # accepted, ignored

    def unsupported(self) -> list[tuple[str, str]]:
        """(parameter, what is not implemented) for each part that asks for what cb-serve lacks."""
        out = []
        for i, tool in enumerate(self.tools or ()):
            if isinstance(tool, ServerTool):
                out.append((f"tools.{i}", f"server tools ({tool.type})"))
            elif tool.input_examples:
                out.append((f"tools.{i}.input_examples", "tool input examples"))
        for i, message in enumerate(self.messages):
            blocks = message.content if isinstance(message.content, list) else []
            for j, block in enumerate(blocks):
                where = f"messages.{i}.content.{j}"
                if isinstance(block, OtherBlock):
                    out.append((where, f"{BLOCKS_SERVED} ({block.type})"))
                elif isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                    out += [(f"{where}.content.{k}", f"{BLOCKS_SERVED} ({part.type})")
                            for k, part in enumerate(block.content) if isinstance(part, OtherBlock)]  # fmt: skip
        return out


class CountTokensRequest(ConversationRequest):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(ConversationRequest):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, ignored
    inference_geo: str | None = None  # accepted, ignored
    # Declared only to refuse them (see unsupported()).
    container: Any = None
    mcp_servers: Any = None
    diagnostics: Any = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        for name, what in (("container", "containers"), ("mcp_servers", "MCP servers"), ("diagnostics", "diagnostics")):
            if getattr(self, name) is not None:
                out.append((name, what))
        return out
