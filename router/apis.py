"""Request bodies of the three API surfaces (OpenAI, Anthropic, cached contents), as pydantic models.

Unknown fields are accepted and ignored, as the hosted APIs do; what kvgrid needs is validated."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class _OpenAIRequest(_Body):
    """What chat and text completions share."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cached_content: str | None = None


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)


class CacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: str | None = None


class ContentBlock(_Body):
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class MessagesRequest(_Body):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = 0
    stop_sequences: list[str] | None = None
    stream: bool = False
    cached_content: str | None = None


class CachedContentRequest(_Body):
    model: str | None = None
    contents: list[dict[str, Any]] | None = None
    systemInstruction: dict[str, Any] | None = None  # noqa: N815 (the API's own name)
    ttl: str | None = None


class CachedContentPatch(_Body):
    ttl: str


def gemini_text(parts_holder: dict[str, Any] | None) -> str:
    """The text of a Gemini ``Content`` ({"role", "parts": [{"text"}]})."""
    if not parts_holder:
        return ""
    return "".join(p.get("text", "") for p in parts_holder.get("parts", []) if isinstance(p, dict))
