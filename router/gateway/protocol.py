"""The wire format of the three API surfaces (OpenAI, Anthropic, cached contents): request bodies and the
response bodies and stream chunks, as pydantic models.

Every field kvgrid reads is type-checked strictly (no string-to-number or number-to-string coercion, no NaN or
infinity) and bounded, so a malformed body is answered 400 with the failing field's location, never a crash later
on. Unknown fields are ignored, as the hosted APIs do for fields they add over time; a few common fields the
engine does not apply (frequency and presence penalties, ``logit_bias``, ``audio``, ``modalities``, ``echo``,
vLLM's ``guided_*``, ``min_tokens``, ``use_beam_search``, ...) are declared so that a request setting them is
refused by name (``unsupported``) instead of being silently ignored. vLLM's sampling extras ``top_k``, ``min_p``,
``repetition_penalty`` and ``stop_token_ids`` are honoured on the OpenAI endpoints. Tool names follow the APIs'
rule (``^[a-zA-Z0-9_-]{1,64}$``). Content parts
other than text, tool calls and tool results (images, documents) are refused: the served model reads text only.
Tools, tool calls and ``response_format`` are router/gateway/tools.py's.

String message content is normalised to a one-element list of text parts, so the gateway reads one shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from common.config import parse_duration
from common.errors import validation_message
from common.sampling import MAX_REPETITION_PENALTY, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

# Each text field alone; the gateway's 4 MiB body limit bounds the whole request.
MAX_TEXT_CHARS = 2**21
MAX_MESSAGES = 4096
MAX_PARTS = 256  # content parts of one message
MAX_NAME_CHARS = 256  # model names, cached-content names, tool and user names
MAX_OUTPUT_TOKENS = 2**24  # far above any context; the gateway then checks the tenant's and the model's limits
MAX_PROMPT_IDS = 2**20
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
MAX_CACHE_KEY_CHARS = 1024
INT64 = 2**63


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
# A tool (function) name, as OpenAI and Anthropic define it: it is generated verbatim in a forced call's output.
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class TextPart(_Body):
    """An OpenAI content part; only text ones are accepted."""

    type: Literal["text"]
    text: Text


def _as_parts(value: Any) -> Any:
    """A string content becomes one text part; anything else but a list or null is refused here, with a message
    that names both accepted shapes (pydantic's own would name only the list)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if value is not None and not isinstance(value, list):
        raise PydanticCustomError("content_type", "content must be a string or a list of content parts")
    return value


def _string_or_parts(schema: dict[str, Any]) -> None:
    """Show the string shape that ``_as_parts`` accepts in the JSON schema too."""
    string = {"type": "string", "maxLength": MAX_TEXT_CHARS}
    if "anyOf" in schema:
        schema["anyOf"].insert(0, string)
    else:
        schema["anyOf"] = [string, {k: schema.pop(k) for k in ("type", "items", "maxItems")}]


# A message content: a string or a list of content parts (a string becomes one text part), or null where the
# field has the default None. An OpenAI message's parts are TextParts; an Anthropic message's, ContentBlocks.
TextParts = Annotated[list[TextPart], Field(max_length=MAX_PARTS)]
ChatContent = Annotated[TextParts | None, BeforeValidator(_as_parts), Field(json_schema_extra=_string_or_parts)]


def _one_or_list(value: Any) -> Any:
    """A single stop string is a list of one, so that errors name the list item, not a union branch."""
    if isinstance(value, str):
        return [value]
    if value is not None and not isinstance(value, list):
        raise PydanticCustomError("stop_type", "stop must be a string or a list of strings")
    return value


def _one_or_list_schema(schema: dict[str, Any]) -> None:
    schema["anyOf"].insert(0, {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS})


def _prompt_kind(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "token_ids" if isinstance(value, list) else None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1, max_length=MAX_PROMPT_IDS)]
# Tagged by the JSON type, so an error names the shape that was sent ("prompt.token_ids.3: ...").
Prompt = Annotated[
    Annotated[Text, Tag("text")] | Annotated[TokenIds, Tag("token_ids")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="prompt must be a string or a list of token ids",
    ),
]


class FunctionCall(_Body):
    name: Name
    arguments: Text  # JSON text of an object, as the API sends it


class ToolCall(_Body):
    """A call an earlier assistant turn made (OpenAI's shape)."""

    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Body):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceName(_Body):
    name: Name


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceName


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaSpec(_Body):
    name: Name
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ChatContent = None
    name: Name | None = None
    tool_call_id: Name | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # an assistant turn's calls

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # an assistant turn may carry only tool calls
            raise ValueError(f"content is required in a {self.role} message")
        return self

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAIRequest(_Body):
    """What chat and text completions share."""

    model: Name
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Annotated[
        Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None,
        BeforeValidator(_one_or_list),
        Field(None, json_schema_extra=_one_or_list_schema),
    ]
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cached_content: Name | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    # vLLM's sampling extensions (common/sampling.py SamplingParams): top_k 0 or -1 is no limit.
    top_k: int = Field(0, ge=-1, lt=2**31)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    # Declared so that a value the engine does not apply is refused by name (``unsupported``), never ignored.
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: Name | None = None
    # Requests of a tenant with the same key go to the same worker group (router/routing/router.py key_group).
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_KEY_CHARS)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # 24h: the prompt is pinned for 24 h
    # vLLM's extensions that the engine does not apply, declared so that they are refused by name (and left out of
    # the API's schema: they are not part of it).
    guided_json: SkipJsonSchema[Any] = None
    guided_regex: SkipJsonSchema[Any] = None
    guided_choice: SkipJsonSchema[Any] = None
    guided_grammar: SkipJsonSchema[Any] = None
    structured_outputs: SkipJsonSchema[Any] = None
    min_tokens: SkipJsonSchema[Any] = None
    use_beam_search: SkipJsonSchema[Any] = None
    length_penalty: SkipJsonSchema[Any] = None
    bad_words: SkipJsonSchema[Any] = None

    def unsupported(self) -> str | None:
        """The 400 message for the first field set to something the engine does not do, naming it (None when
        everything asked for is honoured)."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                return f"{name}: not supported by this server (omit it or send 0; repetition_penalty is supported)"
        if self.logit_bias:
            return "logit_bias: not supported by this server (omit it or send {})"
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
            if getattr(self, name) is not None:
                return f"{name}: not supported by this server (use response_format, or tools with tool_choice)"
        if self.min_tokens not in (None, 0):
            return "min_tokens: not supported by this server (omit it or send 0)"
        if self.use_beam_search not in (None, False):
            return "use_beam_search: beam search is not supported by this server"
        if self.length_penalty not in (None, 1, 1.0):
            return "length_penalty: not supported by this server (it applies to beam search)"
        if self.bad_words not in (None, []):
            return "bad_words: not supported by this server"
        return None


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Declared so that they are refused by name: the served model reads and writes text only.
    audio: dict[str, Any] | None = None
    modalities: list[Annotated[str, Field(max_length=32)]] | None = Field(None, max_length=8)
    reasoning_effort: Annotated[str, Field(max_length=32)] | None = None
    web_search_options: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.reasoning_effort is not None:
            return "reasoning_effort: the served model does not reason (omit it)"
        if self.web_search_options is not None:
            return "web_search_options: web search is not supported by this server"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs: requires logprobs to be true"
        if self.audio is not None:
            return "audio: audio output is not supported by this server"
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            return "modalities: only 'text' is supported by this server"
        return super().unsupported()


class CompletionRequest(_OpenAIRequest):
    """``prompt``: one string (special-token text in it is honoured: a raw prompt is the caller's own template)
    or one list of token ids; batches of prompts are not supported."""

    prompt: Prompt
    max_tokens: int = Field(16, ge=1, le=MAX_OUTPUT_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=5)
    # Declared so that they are refused by name.
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo: not supported by this server"
        if self.suffix:
            return "suffix: not supported by this server"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of: only best_of equal to n is supported by this server"
        return super().unsupported()


class CacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Annotated[str, Field(min_length=1, max_length=32)] | None = None  # "5m", "1h" (or any duration)


class ContentBlock(_Body):
    """An Anthropic content block; only text ones are accepted."""

    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


Blocks = Annotated[list[ContentBlock], Field(max_length=MAX_PARTS)]
AnthropicContent = Annotated[Blocks, BeforeValidator(_as_parts), Field(json_schema_extra=_string_or_parts)]
AnthropicSystem = Annotated[Blocks | None, BeforeValidator(_as_parts), Field(json_schema_extra=_string_or_parts)]


class ToolUseBlockIn(_Body):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockIn(_Body):
    """The result of a call, in a user turn: text, or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: Name
    content: Annotated[Blocks | None, BeforeValidator(_as_parts)] = None
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
    list[MessageBlock], BeforeValidator(_as_parts), Field(max_length=MAX_PARTS, json_schema_extra=_string_or_parts)
]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: MessageBlocks


class AnthropicTool(_Body):
    name: ToolName
    description: Text | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool', and only with it")
        return self


class AnthropicMetadata(_Body):
    user_id: Name | None = None


class MessagesRequest(_Body):
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


class GeminiPart(_Body):
    """A Gemini ``Part``; only text ones are accepted."""

    text: Text


class GeminiContent(_Body):
    role: Name | None = None
    parts: list[GeminiPart] = Field(max_length=MAX_PARTS)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts)


class CachedContentRequest(_Body):
    model: Name | None = None
    contents: list[GeminiContent] | None = Field(None, max_length=MAX_MESSAGES)
    systemInstruction: GeminiContent | None = None  # noqa: N815 (the API's own name)
    ttl: Annotated[str, Field(max_length=32)] | None = None
    displayName: Name | None = None  # noqa: N815

    @property
    def text(self) -> str:
        """All the object's text: the system instruction, then every content."""
        parts = [self.systemInstruction] if self.systemInstruction else []
        return "".join(c.text for c in parts + list(self.contents or []))


class CachedContentPatch(_Body):
    ttl: Annotated[str, Field(min_length=1, max_length=32)]


# -- responses --------------------------------------------------------------------------------------------------
# The bodies and stream chunks the gateway answers with, field for field what the hosted APIs send (the official
# SDKs parse them). Optional parts that the APIs leave out when absent (a chunk's ``usage``) are left out here too;
# every other field is always sent, null included.


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def sse(self, event: str | None = None) -> str:
        """This object as one server-sent event: ``data: {json}``, under ``event: {event}`` when given."""
        data = f"data: {self.model_dump_json()}\n\n"
        return data if event is None else f"event: {event}\n{data}"


class SseTemplate:
    """A server-sent event rendered once around a placeholder text, then filled per call by splicing a JSON string
    in: the event ``render(text)`` would give (the same JSON, parsed), without building and dumping the models
    again. A stream's text chunks differ only in their text, and one is sent per token."""

    _MARK = "\ue000kvgrid-text\ue001"  # private-use characters: JSON writes them as they are

    def __init__(self, render: Callable[[str], str]) -> None:
        quoted = json.dumps(self._MARK, ensure_ascii=False)
        parts = render(self._MARK).split(quoted)
        if len(parts) != 2:
            raise ValueError("the rendered event must hold the placeholder text exactly once")
        self.head, self.tail = parts

    def __call__(self, text: str) -> str:
        return f"{self.head}{json.dumps(text, ensure_ascii=False)}{self.tail}"


class _OmitNone(_Reply):
    """A reply whose ``_omit_none`` fields are left out when they are None."""

    _omit_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._omit_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


# OpenAI


class OpenAIModel(_Reply):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvgrid"


class OpenAIModelList(_Reply):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class PromptTokensDetails(_Reply):
    cached_tokens: int


class OpenAIUsage(_Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # DeepSeek's names for the same split (its SDK users read these): hit = cached_tokens, hit + miss = prompt_tokens.
    prompt_cache_hit_tokens: int
    prompt_cache_miss_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> OpenAIUsage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            prompt_cache_hit_tokens=cached,
            prompt_cache_miss_tokens=prompt - cached,
        )


class FunctionCallOut(_Reply):
    name: str
    arguments: str


class ToolCallOut(_Reply):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(_Reply):
    """A whole call in one stream chunk (kvgrid sends each call once it is complete)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(_Reply):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Reply):
    """One output token of a chat completion: its text, log-probability, UTF-8 bytes and the most likely
    alternatives at its position."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Reply):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(_Reply):
    """The legacy completions shape: parallel lists over the output tokens; each ``top_logprobs`` entry maps
    the most likely tokens (and the chosen one) to their log-probabilities."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(_Reply):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class CompletionChoice(_Reply):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class ChatCompletion(_Reply):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage


class TextCompletion(_Reply):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage


class ChatDelta(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"role", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"logprobs"})
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None  # of this chunk's tokens, when asked for


class CompletionChunkChoice(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"logprobs"})
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class OpenAIChunk(_OmitNone):
    """One streamed chunk of a chat (``chat.completion.chunk``) or text (``text_completion``) completion; the
    last one of a stream that asked for usage has no choices and the usage."""

    _omit_none: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChunkChoice | CompletionChunkChoice]
    usage: OpenAIUsage | None = None


class OpenAIErrorDetail(_Reply):
    message: str
    type: str
    param: None = None
    code: int  # the HTTP status


class OpenAIError(_Reply):
    error: OpenAIErrorDetail


class OpenAIStreamErrorDetail(_Reply):
    message: str
    type: str


class OpenAIStreamError(_Reply):
    """An error that ends a stream already under way (its HTTP status was sent)."""

    error: OpenAIStreamErrorDetail


# Anthropic


class TextBlock(_Reply):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(_Reply):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class CacheCreation(_Reply):
    """Anthropic's split of ``cache_creation_input_tokens`` by the TTL the tokens were written for."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class AnthropicUsage(_Reply):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int
    cache_creation: CacheCreation = CacheCreation()


class AnthropicMessageReply(_Reply):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(_Reply):
    """The reply of Anthropic's ``count_tokens``."""

    input_tokens: int


class AnthropicErrorDetail(_Reply):
    type: str
    message: str


class AnthropicError(_Reply):
    """An error body, and the error event that ends a stream already under way."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class MessageStart(_Reply):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessageReply


class ContentBlockStart(_Reply):
    type: Literal["content_block_start"] = "content_block_start"
    index: int = 0
    content_block: TextBlock | ToolUseBlock


class TextDelta(_Reply):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(_Reply):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(_Reply):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int = 0
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(_Reply):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int = 0


class StopInfo(_Reply):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(_Reply):
    type: Literal["message_delta"] = "message_delta"
    delta: StopInfo
    usage: AnthropicUsage


class MessageStop(_Reply):
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


class UsageMetadata(_Reply):
    totalTokenCount: int  # noqa: N815 (the API's own names)


class CachedContentReply(_Reply):
    name: str
    contents: dict[str, Any]  # what it was created with ({"text": ...})
    usageMetadata: UsageMetadata  # noqa: N815
    createTime: str  # noqa: N815
    expireTime: str  # noqa: N815


class CachedContentList(_Reply):
    cachedContents: list[CachedContentReply]  # noqa: N815


MAX_BODY_BYTES = 4 * 2**20


class BodyError(Exception):
    """A request body that is too large (413) or does not match its model (400: ``"{field}: {problem}"``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def parse_body(request, model: type[BaseModel], max_bytes: int = MAX_BODY_BYTES):
    """``request``'s JSON body as ``model``, read no further than ``max_bytes`` (a chunked upload has no length).
    The gateway and the admin API both read bodies here; each words a ``BodyError`` in its own API's format."""
    if int(request.headers.get("content-length") or 0) > max_bytes:
        raise BodyError(413, f"request body exceeds {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyError(413, f"request body exceeds {max_bytes} bytes")
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as exc:
        raise BodyError(400, validation_message(exc, "body")) from None


def ttl_seconds(value: str | None, default: float, longest: float, field: str) -> float:
    """The seconds of a TTL a request gives in ``field`` (``"300s"``, ``"5m"``: ``parse_duration``), or
    ``default`` when it gives none; a ``BodyError`` (400, naming the field) when it is no duration or outside
    1 s .. ``longest``."""
    try:
        seconds = parse_duration(value) if value else default
    except ValueError as exc:
        raise BodyError(400, f"{field}: {exc}") from None
    if not 1.0 <= seconds <= longest:
        raise BodyError(400, f"{field} must be between 1s and {longest:.0f}s")
    return seconds


# -- the Gemini API (v1beta): requests and replies ---------------------------------------------------------------
# Field names are the API's own (camelCase, as the google-genai SDK sends them).


class GeminiGenerationConfig(_Body):
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    topP: float | None = Field(None, gt=0.0, le=1.0)  # noqa: N815
    topK: float | None = Field(None, ge=0.0, lt=2**31)  # noqa: N815 (the SDK types it as a number)
    maxOutputTokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)  # noqa: N815
    stopSequences: list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)  # noqa: N815
    candidateCount: int | None = Field(None, ge=1, le=8)  # noqa: N815
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    responseMimeType: Name | None = None  # noqa: N815
    # Declared so that the gateway can refuse them by name: the engine does not apply them.
    responseSchema: dict[str, Any] | None = None  # noqa: N815
    responseJsonSchema: Any = None  # noqa: N815
    presencePenalty: float | None = None  # noqa: N815
    frequencyPenalty: float | None = None  # noqa: N815
    responseLogprobs: bool | None = None  # noqa: N815
    logprobs: int | None = None
    responseModalities: list[Name] | None = None  # noqa: N815
    thinkingConfig: dict[str, Any] | None = None  # noqa: N815


class GenerateContentRequest(_Body):
    contents: list[GeminiContent] = Field(min_length=1, max_length=MAX_MESSAGES)
    systemInstruction: GeminiContent | None = None  # noqa: N815
    generationConfig: GeminiGenerationConfig = GeminiGenerationConfig()  # noqa: N815
    cachedContent: Name | None = None  # noqa: N815
    tools: list[dict[str, Any]] | None = None  # refused by name (the Gemini API's tools are not served)
    toolConfig: dict[str, Any] | None = None  # noqa: N815


class CountTokensRequest(_Body):
    contents: list[GeminiContent] | None = Field(None, max_length=MAX_MESSAGES)
    generateContentRequest: GenerateContentRequest | None = None  # noqa: N815


class GeminiCachedContentRequest(_Body):
    model: Name
    contents: list[GeminiContent] | None = Field(None, max_length=MAX_MESSAGES)
    systemInstruction: GeminiContent | None = None  # noqa: N815
    ttl: Annotated[str, Field(min_length=1, max_length=32)] | None = None
    expireTime: Annotated[str, Field(min_length=1, max_length=64)] | None = None  # noqa: N815
    displayName: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None  # noqa: N815
    tools: list[dict[str, Any]] | None = None
    toolConfig: dict[str, Any] | None = None  # noqa: N815


class GeminiCachedContentPatch(_Body):
    ttl: Annotated[str, Field(min_length=1, max_length=32)] | None = None
    expireTime: Annotated[str, Field(min_length=1, max_length=64)] | None = None  # noqa: N815


class GeminiTextPart(_Reply):
    text: str


class GeminiReplyContent(_Reply):
    role: Literal["model"] = "model"
    parts: list[GeminiTextPart]


class GeminiCandidate(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"finishReason"})
    content: GeminiReplyContent
    finishReason: str | None = None  # noqa: N815 (STOP, MAX_TOKENS or OTHER; absent until the end)
    index: int = 0


class GeminiUsage(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"cachedContentTokenCount"})
    promptTokenCount: int  # noqa: N815
    candidatesTokenCount: int  # noqa: N815
    totalTokenCount: int  # noqa: N815
    cachedContentTokenCount: int | None = None  # noqa: N815 (left out when nothing was reused, as Gemini does)


class GenerateContentReply(_Reply):
    candidates: list[GeminiCandidate]
    usageMetadata: GeminiUsage  # noqa: N815
    modelVersion: str  # noqa: N815
    responseId: str  # noqa: N815


class CountTokensReply(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"cachedContentTokenCount"})
    totalTokens: int  # noqa: N815
    cachedContentTokenCount: int | None = None  # noqa: N815


class GeminiCachedContentReply(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"displayName"})
    name: str
    model: str
    displayName: str | None = None  # noqa: N815
    createTime: str  # noqa: N815
    updateTime: str  # noqa: N815
    expireTime: str  # noqa: N815
    usageMetadata: UsageMetadata  # noqa: N815


class GeminiCachedContentList(_OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"nextPageToken"})
    cachedContents: list[GeminiCachedContentReply]  # noqa: N815
    nextPageToken: str | None = None  # noqa: N815


class GeminiErrorDetail(_Reply):
    code: int
    message: str
    status: str


class GeminiError(_Reply):
    error: GeminiErrorDetail
