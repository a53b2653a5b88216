"""The OpenAI API's wire format (chat completions, completions, models): request bodies, replies and stream
chunks as pydantic models, field for field what the official SDK sends and parses.

A few common fields the engine does not apply (frequency and presence penalties, ``logit_bias``, ``audio``,
``modalities``, ``echo``, vLLM's ``guided_*``, ``min_tokens``, ``use_beam_search``, ...) are declared so that a
request setting them is refused by name (``unsupported``) instead of being silently ignored. vLLM's sampling
extras ``top_k``, ``min_p``, ``repetition_penalty`` and ``stop_token_ids`` are honoured. Content parts other than
text are refused: the served model reads text only. Tools, tool calls and ``response_format`` are
router/gateway/tools.py's. String message content is normalised to a one-element list of text parts."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from common.sampling import MAX_REPETITION_PENALTY, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from router.gateway.wire import (
    INT64,
    MAX_CACHE_KEY_CHARS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_IDS,
    MAX_TOOLS,
    Body,
    ChatContent,
    Name,
    OmitNone,
    Reply,
    StopString,
    Text,
    ToolName,
    one_or_list,
    one_or_list_schema,
)


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


class FunctionCall(Body):
    name: Name
    arguments: Text  # JSON text of an object, as the API sends it


class ToolCall(Body):
    """A call an earlier assistant turn made (OpenAI's shape)."""

    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(Body):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceName(Body):
    name: Name


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ToolChoiceName


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaSpec(Body):
    name: Name
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class ChatMessage(Body):
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


class StreamOptions(Body):
    include_usage: bool = False


class _OpenAIRequest(Body):
    """What chat and text completions share."""

    model: Name
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Annotated[
        Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None,
        BeforeValidator(one_or_list),
        Field(None, json_schema_extra=one_or_list_schema),
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


class OpenAIModel(Reply):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvgrid"
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for the base model itself


class OpenAIModelList(Reply):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class PromptTokensDetails(Reply):
    cached_tokens: int


class OpenAIUsage(Reply):
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


class FunctionCallOut(Reply):
    name: str
    arguments: str


class ToolCallOut(Reply):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(Reply):
    """A whole call in one stream chunk (kvgrid sends each call once it is complete)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(Reply):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Reply):
    """One output token of a chat completion: its text, log-probability, UTF-8 bytes and the most likely
    alternatives at its position."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Reply):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(Reply):
    """The legacy completions shape: parallel lists over the output tokens; each ``top_logprobs`` entry maps
    the most likely tokens (and the chosen one) to their log-probabilities."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(Reply):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class CompletionChoice(Reply):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class ChatCompletion(Reply):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage


class TextCompletion(Reply):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage


class ChatDelta(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"role", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"logprobs"})
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None  # of this chunk's tokens, when asked for


class CompletionChunkChoice(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"logprobs"})
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class OpenAIChunk(OmitNone):
    """One streamed chunk of a chat (``chat.completion.chunk``) or text (``text_completion``) completion; the
    last one of a stream that asked for usage has no choices and the usage."""

    _omit_none: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChunkChoice | CompletionChunkChoice]
    usage: OpenAIUsage | None = None


class OpenAIErrorDetail(Reply):
    message: str
    type: str
    param: None = None
    code: int  # the HTTP status


class OpenAIError(Reply):
    error: OpenAIErrorDetail


class OpenAIStreamErrorDetail(Reply):
    message: str
    type: str


class OpenAIStreamError(Reply):
    """An error that ends a stream already under way (its HTTP status was sent)."""

    error: OpenAIStreamErrorDetail
