"""The Anthropic Messages API's wire format: request bodies (with ``cache_control`` breakpoints, tools and tool
results), the message reply, the token count and the stream's events, as pydantic models. Content blocks other
than text, tool use and tool results (images, documents) are refused: the served model reads text only."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from common.sampling import MAX_STOP_STRINGS
from router.gateway.wire import (
    MAX_MESSAGES,
    MAX_OUTPUT_TOKENS,
    MAX_PARTS,
    MAX_TOOLS,
    Body,
    Name,
    Reply,
    StopString,
    Text,
    ToolName,
    as_parts,
    string_or_parts,
)


class CacheControl(Body):
    type: Literal["ephemeral"]
    ttl: Annotated[str, Field(min_length=1, max_length=32)] | None = None  # "5m", "1h" (or any duration)


class ContentBlock(Body):
    """An Anthropic content block; only text ones are accepted."""

    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


Blocks = Annotated[list[ContentBlock], Field(max_length=MAX_PARTS)]
AnthropicContent = Annotated[Blocks, BeforeValidator(as_parts), Field(json_schema_extra=string_or_parts)]
AnthropicSystem = Annotated[Blocks | None, BeforeValidator(as_parts), Field(json_schema_extra=string_or_parts)]


class ToolUseBlockIn(Body):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockIn(Body):
    """The result of a call, in a user turn: text, or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: Name
    content: Annotated[Blocks | None, BeforeValidator(as_parts)] = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.content or [])


def _block_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return kind if kind in ("text", "tool_use", "tool_result") else None


# Tagged by ``type``, so an error names the block kind that was sent ("messages.0.content.1.tool_use.id: ...").
MessageBlock = Annotated[
    Annotated[ContentBlock, Tag("text")]
    | Annotated[ToolUseBlockIn, Tag("tool_use")]
    | Annotated[ToolResultBlockIn, Tag("tool_result")],
    Discriminator(
        _block_kind,
        custom_error_type="block_type",
        custom_error_message="type: a content block must be of type text, tool_use or tool_result",
    ),
]
MessageBlocks = Annotated[
    list[MessageBlock], BeforeValidator(as_parts), Field(max_length=MAX_PARTS, json_schema_extra=string_or_parts)
]


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: MessageBlocks


class AnthropicTool(Body):
    name: ToolName
    description: Text | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool', and only with it")
        return self


class AnthropicMetadata(Body):
    user_id: Name | None = None


class MessagesRequest(Body):
    model: Name
    max_tokens: int = Field(ge=1, le=MAX_OUTPUT_TOKENS)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: AnthropicSystem = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=2**31)
    stop_sequences: list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    cached_content: Name | None = None
    metadata: AnthropicMetadata | None = None
    thinking: dict[str, Any] | None = None  # declared so that extended thinking is refused by name

    def unsupported(self) -> str | None:
        """The 400 message for a field the engine does not honour, naming it (None when all is honoured)."""
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            return "thinking: extended thinking is not supported by this server"
        return None


class CountTokensBody(MessagesRequest):
    """``/v1/messages/count_tokens``: a messages body without ``max_tokens`` (sampling fields are ignored)."""

    max_tokens: int = Field(1, ge=1, le=MAX_OUTPUT_TOKENS)


# Anthropic


class TextBlock(Reply):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(Reply):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class CacheCreation(Reply):
    """Anthropic's split of ``cache_creation_input_tokens`` by the TTL the tokens were written for."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class AnthropicUsage(Reply):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int
    cache_creation: CacheCreation = CacheCreation()


class AnthropicMessageReply(Reply):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(Reply):
    """The reply of Anthropic's ``count_tokens``."""

    input_tokens: int


class AnthropicErrorDetail(Reply):
    type: str
    message: str


class AnthropicError(Reply):
    """An error body, and the error event that ends a stream already under way."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class MessageStart(Reply):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessageReply


class ContentBlockStart(Reply):
    type: Literal["content_block_start"] = "content_block_start"
    index: int = 0
    content_block: TextBlock | ToolUseBlock


class TextDelta(Reply):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(Reply):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(Reply):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int = 0
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(Reply):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int = 0


class StopInfo(Reply):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(Reply):
    type: Literal["message_delta"] = "message_delta"
    delta: StopInfo
    usage: AnthropicUsage


class MessageStop(Reply):
    type: Literal["message_stop"] = "message_stop"


AnthropicEvent = (
    MessageStart
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | AnthropicError
)  # an error event carries what an error body does


def anthropic_event(event: AnthropicEvent) -> str:
    """A stream event as Anthropic sends it: its ``type`` as the event name, the object as its data."""
    return event.sse(event.type)


# Cached contents (Gemini's shape)
