"""The Gemini API's (v1beta) wire format, field names as the google-genai SDK sends them (camelCase):
generateContent and countTokens bodies and replies, and cached contents, which the tenant cached-contents API
(router/gateway/gemini/cached_contents.py) shares."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
)

from common.sampling import MAX_STOP_STRINGS
from router.gateway.wire import (
    INT64,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_OUTPUT_TOKENS,
    MAX_PARTS,
    Body,
    Name,
    OmitNone,
    Reply,
    StopString,
    Text,
)


class GeminiPart(Body):
    """A Gemini ``Part``; only text ones are accepted."""

    text: Text


class GeminiContent(Body):
    role: Name | None = None
    parts: list[GeminiPart] = Field(max_length=MAX_PARTS)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts)


class CachedContentRequest(Body):
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


class CachedContentPatch(Body):
    ttl: Annotated[str, Field(min_length=1, max_length=32)]


class UsageMetadata(Reply):
    totalTokenCount: int  # noqa: N815 (the API's own names)


class CachedContentReply(Reply):
    name: str
    contents: dict[str, Any]  # what it was created with ({"text": ...})
    usageMetadata: UsageMetadata  # noqa: N815
    createTime: str  # noqa: N815
    expireTime: str  # noqa: N815


class CachedContentList(Reply):
    cachedContents: list[CachedContentReply]  # noqa: N815


# -- the Gemini API (v1beta): requests and replies ---------------------------------------------------------------
# Field names are the API's own (camelCase, as the google-genai SDK sends them).


class GeminiGenerationConfig(Body):
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


class GenerateContentRequest(Body):
    contents: list[GeminiContent] = Field(min_length=1, max_length=MAX_MESSAGES)
    systemInstruction: GeminiContent | None = None  # noqa: N815
    generationConfig: GeminiGenerationConfig = GeminiGenerationConfig()  # noqa: N815
    cachedContent: Name | None = None  # noqa: N815
    tools: list[dict[str, Any]] | None = None  # refused by name (the Gemini API's tools are not served)
    toolConfig: dict[str, Any] | None = None  # noqa: N815


class CountTokensRequest(Body):
    contents: list[GeminiContent] | None = Field(None, max_length=MAX_MESSAGES)
    generateContentRequest: GenerateContentRequest | None = None  # noqa: N815


class GeminiCachedContentRequest(Body):
    model: Name
    contents: list[GeminiContent] | None = Field(None, max_length=MAX_MESSAGES)
    systemInstruction: GeminiContent | None = None  # noqa: N815
    ttl: Annotated[str, Field(min_length=1, max_length=32)] | None = None
    expireTime: Annotated[str, Field(min_length=1, max_length=64)] | None = None  # noqa: N815
    displayName: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None  # noqa: N815
    tools: list[dict[str, Any]] | None = None
    toolConfig: dict[str, Any] | None = None  # noqa: N815


class GeminiCachedContentPatch(Body):
    ttl: Annotated[str, Field(min_length=1, max_length=32)] | None = None
    expireTime: Annotated[str, Field(min_length=1, max_length=64)] | None = None  # noqa: N815


class GeminiTextPart(Reply):
    text: str


class GeminiReplyContent(Reply):
    role: Literal["model"] = "model"
    parts: list[GeminiTextPart]


class GeminiCandidate(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"finishReason"})
    content: GeminiReplyContent
    finishReason: str | None = None  # noqa: N815 (STOP, MAX_TOKENS or OTHER; absent until the end)
    index: int = 0


class GeminiUsage(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"cachedContentTokenCount"})
    promptTokenCount: int  # noqa: N815
    candidatesTokenCount: int  # noqa: N815
    totalTokenCount: int  # noqa: N815
    cachedContentTokenCount: int | None = None  # noqa: N815 (left out when nothing was reused, as Gemini does)


class GenerateContentReply(Reply):
    candidates: list[GeminiCandidate]
    usageMetadata: GeminiUsage  # noqa: N815
    modelVersion: str  # noqa: N815
    responseId: str  # noqa: N815


class CountTokensReply(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"cachedContentTokenCount"})
    totalTokens: int  # noqa: N815
    cachedContentTokenCount: int | None = None  # noqa: N815


class GeminiCachedContentReply(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"displayName"})
    name: str
    model: str
    displayName: str | None = None  # noqa: N815
    createTime: str  # noqa: N815
    updateTime: str  # noqa: N815
    expireTime: str  # noqa: N815
    usageMetadata: UsageMetadata  # noqa: N815


class GeminiCachedContentList(OmitNone):
    _omit_none: ClassVar[frozenset[str]] = frozenset({"nextPageToken"})
    cachedContents: list[GeminiCachedContentReply]  # noqa: N815
    nextPageToken: str | None = None  # noqa: N815


class GeminiErrorDetail(Reply):
    code: int
    message: str
    status: str


class GeminiError(Reply):
    error: GeminiErrorDetail
