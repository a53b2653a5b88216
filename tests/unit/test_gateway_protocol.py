"""The gateway's response models (router/gateway/{openai,anthropic,gemini}/protocol.py, router/gateway/wire.py)
put on the wire exactly the fields and values the hosted APIs send (what the official SDKs parse): absent optional
parts left out, nulls kept, server-sent events framed as each API frames them. The SDK tests (test_serve.py and the
others) drive them through real servers."""

from __future__ import annotations

import json

import pytest

from router.gateway import wire
from router.gateway.anthropic import protocol as an
from router.gateway.errors import ApiError, err
from router.gateway.gemini import protocol as gm
from router.gateway.openai import protocol as oa


def sse_data(event: str) -> dict:
    assert event.endswith("\n\n")
    *head, data = event[:-2].split("\n")
    assert data.startswith("data: ")
    return json.loads(data.removeprefix("data: "))


def test_openai_stream_chunks_leave_out_an_absent_usage_and_the_role_after_the_first():
    usage = oa.OpenAIUsage.of(prompt=7, completion=3, cached=4)
    first = oa.OpenAIChunk(
        id="chatcmpl-1",
        object="chat.completion.chunk",
        created=5,
        model="demo",
        choices=[oa.ChatChunkChoice(delta=oa.ChatDelta(role="assistant", content=""), finish_reason=None)],
    )
    assert sse_data(first.sse()) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "demo",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    }
    later = oa.ChatChunkChoice(delta=oa.ChatDelta(content="hé"), finish_reason="stop")
    assert later.model_dump() == {"index": 0, "delta": {"content": "hé"}, "finish_reason": "stop"}
    text = oa.OpenAIChunk(
        id="cmpl-1",
        object="text_completion",
        created=5,
        model="demo",
        choices=[oa.CompletionChunkChoice(text="x", finish_reason=None)],
    )
    assert "usage" not in sse_data(text.sse())
    tail = oa.OpenAIChunk(id="cmpl-1", object="text_completion", created=5, model="demo", choices=[], usage=usage)
    assert sse_data(tail.sse()) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "demo",
        "choices": [],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 4},
            "prompt_cache_hit_tokens": 4,  # DeepSeek's names, consistent with the OpenAI ones
            "prompt_cache_miss_tokens": 3,
        },
    }
    assert sse_data(oa.OpenAIStreamError(error=oa.OpenAIStreamErrorDetail(message="m", type="api_error")).sse()) == {
        "error": {"message": "m", "type": "api_error"}
    }


def test_a_text_chunk_template_gives_the_event_the_models_give_for_any_text():
    def render(chat: bool, index: int, text: str) -> str:
        choice = (
            oa.ChatChunkChoice(index=index, delta=oa.ChatDelta(content=text), finish_reason=None)
            if chat
            else oa.CompletionChunkChoice(index=index, text=text, finish_reason=None)
        )
        obj = "chat.completion.chunk" if chat else "text_completion"
        return oa.OpenAIChunk(id='cmpl-"1', object=obj, created=5, model="dé/mo", choices=[choice]).sse()

    texts = ["", "hello", 'a "quote" and a \\ back', "new\nline\ttab\r\x00\x1f\x7f", "ünï 😀", "\u2028\u2029"]
    texts.append(wire.SseTemplate._MARK)  # the placeholder itself is just text once the template is made
    for chat in (False, True):
        for index in (0, 3):
            fill = wire.SseTemplate(lambda text, chat=chat, index=index: render(chat, index, text))
            for text in texts:
                event = fill(text)
                assert event.startswith("data: ") and event.endswith("\n\n")
                assert sse_data(event) == sse_data(render(chat, index, text)), text
                got = sse_data(event)["choices"][0]
                assert (got["delta"]["content"] if chat else got["text"]) == text and got["index"] == index


def test_a_template_needs_its_placeholder_exactly_once():
    with pytest.raises(ValueError):
        wire.SseTemplate(lambda text: "data: {}\n\n")
    with pytest.raises(ValueError):
        twice = lambda text: "data: [%s, %s]\n\n" % ((json.dumps(text, ensure_ascii=False),) * 2)  # noqa: E731
        wire.SseTemplate(twice)


def test_openai_bodies_keep_their_nulls():
    usage = oa.OpenAIUsage.of(prompt=2, completion=1, cached=0)
    chat = oa.ChatCompletion(
        id="c",
        created=1,
        model="demo",
        usage=usage,
        choices=[oa.ChatChoice(message=oa.AssistantMessage(content="hi"), finish_reason="length")],
    )
    assert json.loads(chat.model_dump_json()) == {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "demo",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length", "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": 2,
            "completion_tokens": 1,
            "total_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 0},
            "prompt_cache_hit_tokens": 0,
            "prompt_cache_miss_tokens": 2,
        },
    }
    text = oa.TextCompletion(
        id="t", created=1, model="demo", usage=usage, choices=[oa.CompletionChoice(text="hi", finish_reason="stop")]
    )
    assert json.loads(text.model_dump_json())["choices"] == [
        {"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": None}
    ]
    models = oa.OpenAIModelList(data=[oa.OpenAIModel(id="demo"), oa.OpenAIModel(id="sql", parent="demo")])
    assert models.model_dump() == {  # an adapter names its base model (vLLM's "parent"); the base has none
        "object": "list",
        "data": [
            {"id": "demo", "object": "model", "created": 0, "owned_by": "kvgrid", "parent": None},
            {"id": "sql", "object": "model", "created": 0, "owned_by": "kvgrid", "parent": "demo"},
        ],
    }


def test_anthropic_events_are_named_by_their_type_and_carry_it():
    usage = an.AnthropicUsage(
        input_tokens=5,
        cache_creation_input_tokens=16,
        cache_read_input_tokens=32,
        output_tokens=0,
        cache_creation=an.CacheCreation(ephemeral_1h_input_tokens=16),
    )
    start = an.MessageStart(
        message=an.AnthropicMessageReply(
            id="msg_1", model="demo", content=[], stop_reason=None, stop_sequence=None, usage=usage
        )
    )
    event = an.anthropic_event(start)
    assert event.startswith("event: message_start\ndata: {")
    assert sse_data(event) == {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "demo",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 5,
                "cache_creation_input_tokens": 16,
                "cache_read_input_tokens": 32,
                "output_tokens": 0,
                "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 16},
            },
        },
    }
    assert sse_data(an.anthropic_event(an.ContentBlockStart(content_block=an.TextBlock(text="")))) == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert sse_data(an.anthropic_event(an.ContentBlockDelta(delta=an.TextDelta(text="a")))) == {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "a"},
    }
    assert sse_data(an.anthropic_event(an.ContentBlockStop())) == {"type": "content_block_stop", "index": 0}
    delta = an.MessageDelta(delta=an.StopInfo(stop_reason="stop_sequence", stop_sequence="END"), usage=usage)
    assert sse_data(an.anthropic_event(delta)) == {
        "type": "message_delta",
        "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
        "usage": usage.model_dump(),
    }
    assert an.anthropic_event(an.MessageStop()) == 'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    error = an.AnthropicError(error=an.AnthropicErrorDetail(type="overloaded_error", message="m"))
    assert sse_data(an.anthropic_event(error)) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "m"},
    }


def test_error_bodies_are_in_the_calling_apis_format_with_retry_after_when_retryable():
    anthropic = err(429, "slow down", "anthropic", retry_after=2.5).response()
    assert anthropic.status_code == 429 and anthropic.headers["retry-after"] == "3"
    assert anthropic.headers["content-type"] == "application/json"
    assert json.loads(anthropic.body) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    openai = err(401, "invalid API key for this tenant", "openai").response()
    assert openai.status_code == 401 and "retry-after" not in openai.headers
    assert json.loads(openai.body) == {
        "error": {
            "message": "invalid API key for this tenant",
            "type": "invalid_request_error",
            "param": None,
            "code": 401,
        }
    }
    failed = ApiError(500, "boom", "api_error", "openai").response()
    assert json.loads(failed.body)["error"] == {"message": "boom", "type": "api_error", "param": None, "code": 500}


def test_a_cached_content_reply_shows_no_token_ids():
    from router.gateway.store import CachedContent

    cc = CachedContent("cachedContents/abc", "acme", {"text": "doc"}, [1, 2, 3], 0.5, 3600.25)
    assert json.loads(gm.CachedContentList(cachedContents=[cc.public()]).model_dump_json()) == {
        "cachedContents": [
            {
                "name": "cachedContents/abc",
                "contents": {"text": "doc"},
                "usageMetadata": {"totalTokenCount": 3},
                "createTime": "1970-01-01T00:00:00.500000Z",
                "expireTime": "1970-01-01T01:00:00.250000Z",
            }
        ]
    }
