"""What the three APIs' wire formats share: the strict base of every request body and reply, the bounds of
every text field, content given as a string or as parts, server-sent events, and reading a body within its size
limit (``parse_body``; a ``BodyError`` each API words in its own format).

Every field kvgrid reads is type-checked strictly (no string-to-number or number-to-string coercion, no NaN or
infinity) and bounded, so a malformed body is answered 400 with the failing field's location, never a crash
later on. Unknown fields are ignored, as the hosted APIs do for fields they add over time. Each API's own models
are in its folder (router/gateway/{openai,anthropic,gemini}/protocol.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from common.config import parse_duration
from common.errors import validation_message
from common.sampling import MAX_STOP_STRING_CHARS

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


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
# A tool (function) name, as OpenAI and Anthropic define it: it is generated verbatim in a forced call's output.
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class TextPart(Body):
    """An OpenAI content part; only text ones are accepted."""

    type: Literal["text"]
    text: Text


def as_parts(value: Any) -> Any:
    """A string content becomes one text part; anything else but a list or null is refused here, with a message
    that names both accepted shapes (pydantic's own would name only the list)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if value is not None and not isinstance(value, list):
        raise PydanticCustomError("content_type", "content must be a string or a list of content parts")
    return value


def string_or_parts(schema: dict[str, Any]) -> None:
    """Show the string shape that ``as_parts`` accepts in the JSON schema too."""
    string = {"type": "string", "maxLength": MAX_TEXT_CHARS}
    if "anyOf" in schema:
        schema["anyOf"].insert(0, string)
    else:
        schema["anyOf"] = [string, {k: schema.pop(k) for k in ("type", "items", "maxItems")}]


# A message content: a string or a list of content parts (a string becomes one text part), or null where the
# field has the default None. An OpenAI message's parts are TextParts; an Anthropic message's, ContentBlocks.
TextParts = Annotated[list[TextPart], Field(max_length=MAX_PARTS)]
ChatContent = Annotated[TextParts | None, BeforeValidator(as_parts), Field(json_schema_extra=string_or_parts)]


def one_or_list(value: Any) -> Any:
    """A single stop string is a list of one, so that errors name the list item, not a union branch."""
    if isinstance(value, str):
        return [value]
    if value is not None and not isinstance(value, list):
        raise PydanticCustomError("stop_type", "stop must be a string or a list of strings")
    return value


def one_or_list_schema(schema: dict[str, Any]) -> None:
    schema["anyOf"].insert(0, {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS})


# -- responses --------------------------------------------------------------------------------------------------
# The bodies and stream chunks the gateway answers with, field for field what the hosted APIs send (the official
# SDKs parse them). Optional parts that the APIs leave out when absent (a chunk's ``usage``) are left out here too;
# every other field is always sent, null included.


class Reply(BaseModel):
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


class OmitNone(Reply):
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
