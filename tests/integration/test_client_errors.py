"""Hostile and mistaken client requests are answered 4xx in the calling API's own error shape,
naming the field, never 500: deep JSON in tool calls, schemas the grammar engine cannot compile (``$ref``
recursion without an exit, patterns that expand too far, special-token text), tool names outside the APIs' rule,
``max_tokens`` past the context, Anthropic's ``cache_control`` rules; vLLM's sampling extras reach the engine.

One in-process gateway per test (no Ray: its router list is a placeholder), driven through the official
``openai`` and ``anthropic`` SDKs over an ASGI transport. A request that passes every check reaches a stand-in for
``Generation.generate``, which records its ``SamplingParams`` and answers one token."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from common.config import ServeConfig
from common.errors import RequestFailed
from common.outputs import FinishReason, RequestOutput
from common.sampling import SamplingParams
from router.gateway.core import Gateway
from router.gateway.errors import ApiError, group_failure
from router.gateway.generation import GenerateRequest
from router.gateway.store import KeyRing
from worker.models.demo_model import IM_END_TOKEN

KEY = "sk-acme-client-errors-1"


def deep(levels: int, leaf: Any = 1) -> Any:
    for _ in range(levels):
        leaf = [leaf]
    return leaf


class Clients:
    def __init__(self, gw: Gateway, http: httpx2.AsyncClient, params: list[SamplingParams]) -> None:
        self.gw, self.http = gw, http
        self.model = gw.model_id
        self.oa = openai.AsyncOpenAI(base_url="http://gw/acme/v1", api_key=KEY, http_client=http, max_retries=0)
        self.an = anthropic.AsyncAnthropic(base_url="http://gw/acme", api_key=KEY, http_client=http, max_retries=0)
        self.params = params  # of the requests that reached generate

    async def openai_error(self, **body: Any) -> tuple[int, str]:
        """(status, message) of a chat completion that must fail, read from OpenAI's error shape."""
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        with pytest.raises(openai.APIStatusError) as info:
            await self.oa.chat.completions.create(model=self.model, **body)
        error = info.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == info.value.status_code
        return info.value.status_code, error["message"]

    async def anthropic_error(self, **body: Any) -> tuple[int, str]:
        """(status, message) of a messages request that must fail, read from Anthropic's error shape."""
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        body.setdefault("max_tokens", 4)
        with pytest.raises(anthropic.APIStatusError) as info:
            await self.an.messages.create(model=self.model, **body)
        data = info.value.response.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
        return info.value.status_code, data["error"]["message"]


@pytest.fixture()
def gateway(demo_path, redis_client):
    from router.gateway.app import create_app

    config = ServeConfig.model_validate({"model": str(demo_path), "tenants": [{"name": "acme", "api_keys": [KEY]}]})
    gw = Gateway(config, KeyRing.from_config(config), str(demo_path), [None], f"unix://{redis_client.socket_file}")
    return gw, create_app(gw)


def drive(gateway, test) -> Any:
    """``await test(clients)`` against the in-process gateway, closed after it. ``Generation.generate`` is a stand-in
    that records the request's ``SamplingParams`` and answers one token."""
    gw, app = gateway
    params: list[SamplingParams] = []

    def fake_generate(req: GenerateRequest):
        params.append(req.params)

        async def outputs():
            yield RequestOutput("r", req.tenant.name, req.prompt, [5], "ok", [5], "ok", True, FinishReason.STOP, 0), 0

        return outputs()

    gw.generation.generate = fake_generate  # type: ignore[method-assign]

    async def main() -> Any:
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://gw", timeout=60
        ) as http:
            try:
                return await test(Clients(gw, http, params))
            finally:
                await gw.close()

    return asyncio.run(asyncio.wait_for(main(), 120))


# -- item 4: deep JSON --------------------------------------------------------------------------------------------


def test_deep_json_anywhere_in_a_message_is_a_400_naming_the_field(gateway):
    async def test(c: Clients) -> None:
        for args in (json.dumps({"a": deep(475)}), "[" * 100_000 + "]" * 100_000):
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
            status, message = await c.openai_error(
                messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ]
            )
            assert status == 400
            assert message == "messages.1.tool_calls.0.function.arguments: nested deeper than 64 levels"
        status, message = await c.openai_error(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": deep(70)}}}]
        )
        assert status == 400 and message.startswith("tools.0.function.parameters: nested deeper than 64 levels")
        status, message = await c.anthropic_error(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": deep(80)}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]},
            ]
        )
        assert status == 400 and message == "messages.1.content.0.input: nested deeper than 64 levels"
        assert c.params == []

    drive(gateway, test)


# -- item 5: grammars ---------------------------------------------------------------------------------------------

LOOP = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}  # no finite value
TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
EXPLODING = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def test_schemas_the_grammar_engine_cannot_compile_are_a_400_naming_the_field(gateway):
    async def test(c: Clients) -> None:
        field = "response_format.json_schema.schema: "
        cases = [
            ({"$ref": "#"}, "$ref '#' has no finite value"),
            (LOOP, "$ref '#' has no finite value"),
            (
                {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                "$ref '#/$defs/",
            ),
            ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "$ref '#' has no finite value"),
            (EXPLODING, "the pattern '^(a{1000}){1000}$' expands to 1000002 items"),
            ({"type": "object", "patternProperties": {"^x{200}{200}$": {}}}, "the pattern"),
            ({"const": f"done{IM_END_TOKEN}"}, f"holds '{IM_END_TOKEN}', a special token of the served model"),
            ({"type": "object", "properties": {IM_END_TOKEN: {"type": "string"}}}, "holds '<|im_end|>'"),
        ]
        for schema, problem in cases:
            status, message = await c.openai_error(response_format=_format(schema))
            assert status == 400 and message.startswith(field + problem), (schema, message)
            assert "Too many items" not in message and "lexer" not in message
        # A forced call's tool schema, in either API, names the tool's field.
        tools = [
            {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "loop", "parameters": LOOP}},
        ]
        for choice in ("required", {"type": "function", "function": {"name": "loop"}}):
            status, message = await c.openai_error(tools=tools, tool_choice=choice)
            assert status == 400 and message.startswith("tools.1.function.parameters: $ref '#'"), message
        an_tools = [{"name": "ok", "input_schema": {"type": "object"}}, {"name": "boom", "input_schema": EXPLODING}]
        for choice in ({"type": "any"}, {"type": "tool", "name": "boom"}):
            status, message = await c.anthropic_error(tools=an_tools, tool_choice=choice)
            assert status == 400 and message.startswith("tools.1.input_schema: the pattern"), message
        assert c.params == []
        # Recursion with an exit (an array that may be empty) is served, and so is a description that mentions
        # a special token (no grammar writes it).
        described = {"type": "object", "description": f"ends with {IM_END_TOKEN}", "properties": {"kids": TREE}}
        for schema in (TREE, described):
            await c.oa.chat.completions.create(
                model=c.model, messages=[{"role": "user", "content": "hi"}], response_format=_format(schema)
            )
        assert [p.structured_output is not None for p in c.params] == [True, True]

    drive(gateway, test)


def test_tool_names_follow_the_apis_rule(gateway):
    async def test(c: Clients) -> None:
        rule = "String should match pattern '^[a-zA-Z0-9_-]{1,64}$'"
        for name in (f'f"}}</tool_call>{IM_END_TOKEN}', "a" * 65, "get.weather", "", "naïve"):
            tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
            status, message = await c.openai_error(tools=tools, tool_choice="required")
            assert (status, message) == (400, f"tools.0.function.name: {rule}"), name
            status, message = await c.anthropic_error(tools=[{"name": name, "input_schema": {"type": "object"}}])
            assert (status, message) == (400, f"tools.0.name: {rule}"), name
        # Gemini function calling is not served at all: refused by name.
        r = await c.http.post(
            f"/acme/v1beta/models/{c.model}:generateContent",
            headers={"authorization": f"Bearer {KEY}"},
            json={"contents": [{"parts": [{"text": "hi"}]}], "tools": [{"functionDeclarations": [{"name": "a b"}]}]},
        )
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools: ")
        assert r.json()["error"]["status"] == "INVALID_ARGUMENT"
        ok = [{"type": "function", "function": {"name": "get_weather-2", "parameters": {"type": "object"}}}]
        await c.oa.chat.completions.create(
            model=c.model, messages=[{"role": "user", "content": "hi"}], tools=ok, tool_choice="required"
        )
        assert len(c.params) == 1

    drive(gateway, test)


def test_a_grammar_failure_in_the_engine_is_a_short_400():
    failed = RequestFailed(
        "request acme-1 failed: GrammarError: structured output: parser error: Too many items (limit 50000; "
        'ff_tokens); try avoiding single-byte/short lexemes\n<state>\nParser: {"compute_time_us": 13}'
    )
    for api in ("openai", "anthropic", "gemini"):
        exc = group_failure(failed, "g0", api)
        assert isinstance(exc, ApiError) and exc.status == 400 and exc.kind == "invalid_request_error"
        assert exc.message.startswith("the structured output") and "Too many items" not in exc.message
    other = group_failure(RequestFailed("request acme-1 failed: RuntimeError: boom"), "g0", "openai")
    assert isinstance(other, ApiError) and other.status == 500


# -- item 6: parameters, max_tokens, cache_control ----------------------------------------------------------------


def test_vllm_sampling_extras_reach_the_engine_and_the_rest_are_refused_by_name(gateway):
    async def test(c: Clients) -> None:
        extra = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [7, 9]}
        await c.oa.chat.completions.create(
            model=c.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=extra
        )
        await c.oa.completions.create(model=c.model, prompt="hi", max_tokens=2, extra_body={"top_k": -1, "min_p": 0})
        chat, text = c.params
        assert (chat.top_k, chat.min_p, chat.repetition_penalty, chat.stop_token_ids) == (5, 0.1, 1.2, [7, 9])
        assert (text.top_k, text.min_p, text.repetition_penalty) == (-1, 0.0, 1.0)
        for body, start in (
            ({"min_p": 1.5}, "min_p: "),
            ({"repetition_penalty": 0}, "repetition_penalty: "),
            ({"top_k": -2}, "top_k: "),
            ({"guided_json": {"type": "object"}}, "guided_json: not supported"),
            ({"guided_choice": ["a", "b"]}, "guided_choice: not supported"),
            ({"use_beam_search": True}, "use_beam_search: "),
            ({"min_tokens": 5}, "min_tokens: "),
            ({"frequency_penalty": 0.5}, "frequency_penalty: "),
        ):
            status, message = await c.openai_error(extra_body=body)
            assert status == 400 and message.startswith(start), (body, message)
        assert len(c.params) == 2

    drive(gateway, test)


def test_max_tokens_past_the_context_is_refused_not_capped(gateway):
    async def test(c: Clients) -> None:
        ctx = c.gw.max_model_len
        status, message = await c.openai_error(max_tokens=ctx)
        assert status == 400 and message.startswith(
            f"max_tokens: this model's maximum context length is {ctx} tokens; however, you requested "
        )
        prompt = int(message.split("(")[1].split(" in the prompt")[0])
        assert f"({prompt} in the prompt, {ctx} in the completion)" in message
        status, message = await c.openai_error(max_completion_tokens=ctx)
        assert status == 400 and message.startswith("max_completion_tokens: ")
        with pytest.raises(openai.BadRequestError) as info:
            await c.oa.completions.create(model=c.model, prompt="hi", max_tokens=ctx)
        assert info.value.response.json()["error"]["message"].startswith("max_tokens: this model's maximum")
        status, message = await c.anthropic_error(max_tokens=ctx)
        assert status == 400 and message.startswith("max_tokens: this model's maximum context length")
        r = await c.http.post(
            f"/acme/v1beta/models/{c.model}:generateContent",
            headers={"authorization": f"Bearer {KEY}"},
            json={"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": ctx}},
        )
        assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
        assert r.json()["error"]["message"].startswith("generationConfig.maxOutputTokens: this model's maximum")
        assert c.params == []
        # What fits exactly is served; without max_tokens the default stays (the engine caps it to the context).
        await c.oa.chat.completions.create(
            model=c.model, messages=[{"role": "user", "content": "hi"}], max_tokens=ctx - prompt
        )
        await c.oa.chat.completions.create(model=c.model, messages=[{"role": "user", "content": "hi"}])
        await c.oa.completions.create(model=c.model, prompt="hi")
        assert [p.max_tokens for p in c.params] == [ctx - prompt, 256, 16]

    drive(gateway, test)


def test_anthropic_cache_control_rules(gateway):
    def text(t: str, ttl: str | None = None) -> dict:
        cc: dict = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
        return {"type": "text", "text": t, "cache_control": cc}

    async def test(c: Clients) -> None:
        status, message = await c.anthropic_error(messages=[{"role": "user", "content": [text("hi", "")]}])
        assert status == 400 and message.startswith("messages.0.content.0.text.cache_control.ttl: "), message
        status, message = await c.anthropic_error(
            system=[text("Rules.", "5m")], messages=[{"role": "user", "content": [text("hi", "1h")]}]
        )
        assert status == 400 and message.startswith(
            "messages.0.content.0.cache_control.ttl: a breakpoint of 3600s may not follow one of 300s "
            "(system.0.cache_control)"
        ), message
        status, message = await c.anthropic_error(system=[text("", "5m")])
        assert (status, message) == (400, "system.0.cache_control: cache_control cannot be set on an empty text block")
        status, message = await c.anthropic_error(messages=[{"role": "user", "content": [text("hi"), text("")]}])
        assert status == 400 and message.startswith("messages.0.content.1.cache_control: cache_control cannot")
        assert c.params == []
        # Longer TTLs first is fine.
        await c.an.messages.create(
            model=c.model,
            max_tokens=2,
            system=[text("Rules.", "1h")],
            messages=[{"role": "user", "content": [text("hi", "5m")]}],
        )
        assert len(c.params) == 1

    drive(gateway, test)
