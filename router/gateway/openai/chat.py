"""``/{tenant}/v1/chat/completions``: messages rendered with the model's chat template (with tools, forced tool
calls and ``response_format`` from router/gateway/tools.py), answered as a ``ChatCompletion`` or streamed as
``chat.completion.chunk`` events; tool calls are read out of the text, whole or as each one completes."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

from dataclasses import dataclass, field

from fastapi import Request

from common.outputs import RequestOutput
from router.gateway.chat import special_texts
from router.gateway.errors import err
from router.gateway.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatLogprobs,
    ChatRequest,
    FunctionCallOut,
    OpenAIUsage,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)
from router.gateway.openai.serving import API, OpenAIServing, finite
from router.gateway.routes import Routes
from router.gateway.tenants import Slot
from router.gateway.tools import CallStream, Tooling, openai_messages, openai_tooling, parse_calls, response_format

DEFAULT_CHAT_MAX_TOKENS = 256

routes = Routes()  # bound to one ChatCompletions by create_app


def _tooling(body: ChatRequest, specials: tuple[str, ...]) -> Tooling:
    return openai_tooling(body, response_format(body.response_format, specials), specials)


@dataclass
class _ChatStream:
    """A chat stream's state: with tools, each choice's text goes through a ``CallStream`` (a call is sent once it
    is complete) and the calls sent so far are counted."""

    tooling: Tooling
    calls: list[CallStream] | None
    sent: list[int] = field(default_factory=list)


class ChatCompletions(OpenAIServing):
    ID_PREFIX = "chatcmpl-"
    OBJECT = "chat.completion.chunk"

    @routes.post("/{tenant}/v1/chat/completions")
    async def chat_completions(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._chat_completions(slot, request))

    async def _chat_completions(self, slot: Slot, request: Request):
        gw, t = self.gw, slot.tenant
        body: ChatRequest = await self._read(slot, request, ChatRequest)
        try:
            messages = openai_messages(body.messages)
            specials = special_texts(gw.prompts.tokenizer)
            schemas = bool(body.tools) or body.response_format is not None  # compiled to check them: off the loop
            tooling = await gw.prompts.compute(t, _tooling, body, specials, inline=not schemas)
        except ValueError as exc:
            raise err(400, str(exc), API) from None
        prefix, ttl = await gw.prompts.cached_prefix(t, body.cached_content, API)
        rendered = await gw.prompts.chat(t, messages, API, tools=tooling.template)
        prompt = prefix + rendered.token_ids
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        if body.max_completion_tokens or body.max_tokens:  # asked for: refused if it does not fit, never capped
            field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            gw.admission.check_context(prompt, max_tokens, field, API)
        return await self._respond(slot, request, body, prompt, len(prefix), ttl, max_tokens, tooling, rendered)

    def _logprobs_asked(self, body: ChatRequest) -> int | None:
        return (body.top_logprobs or 0) if body.logprobs else None

    def _whole(
        self, rid: str, created: int, usage: OpenAIUsage, outs: list[RequestOutput], tooling: Tooling
    ) -> ChatCompletion:
        return ChatCompletion(
            id=rid,
            created=created,
            model=self.gw.model_id,
            usage=usage,
            choices=[
                ChatChoice(
                    index=out.index,
                    message=message,
                    finish_reason="tool_calls" if message.tool_calls else out.finish_reason,
                    logprobs=self._logprobs(out, len(out.token_ids)),
                )
                for out in outs
                for message in [self._message(out, tooling)]
            ],
        )

    @staticmethod
    def _message(out: RequestOutput, tooling: Tooling) -> AssistantMessage:
        """A chat choice's message: its text, or the tool calls read out of it and the text around them."""
        if not tooling.parse:
            return AssistantMessage(content=out.text)
        text, calls = parse_calls(out.text, "call_")
        if not calls:
            return AssistantMessage(content=out.text)
        calls = calls[:1] if tooling.single else calls
        return AssistantMessage(
            content=text or None,
            tool_calls=[
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls
            ],
        )

    def _logprobs(self, out: RequestOutput, num_new: int) -> ChatLogprobs | None:
        """The chat shape of the logprobs of ``out``'s last ``num_new`` tokens (None when not asked for)."""
        if out.logprobs is None:
            return None
        texts, start = self.token_texts, len(out.token_ids) - num_new
        tops = out.top_logprobs or []
        content = []
        for i in range(start, len(out.token_ids)):
            token, raw = texts(out.token_ids[i])
            alts = sorted(tops[i].items(), key=lambda kv: -kv[1]) if i < len(tops) else []
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=finite(out.logprobs[i]),
                    bytes=raw,
                    top_logprobs=[
                        TopLogprob(token=(alt := texts(tid))[0], logprob=finite(lp), bytes=alt[1]) for tid, lp in alts
                    ],
                )
            )
        return ChatLogprobs(content=content)

    # -- the stream ----------------------------------------------------------------------------------------------

    def _opening(self, n: int) -> list[ChatChunkChoice]:
        return [
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), finish_reason=None)
            for i in range(n)
        ]

    def _stream_state(self, n: int, tooling: Tooling) -> _ChatStream:
        calls = [CallStream("call_") for _ in range(n)] if tooling.parse else None
        return _ChatStream(tooling, calls, [0] * n)

    def _plain_ok(self, state: _ChatStream) -> bool:
        return state.calls is None

    def _plain(self, index: int, text: str) -> ChatChunkChoice:
        return ChatChunkChoice(index=index, delta=ChatDelta(content=text), finish_reason=None)

    def _choices(self, out: RequestOutput, new: int, state: _ChatStream) -> list[ChatChunkChoice]:
        logprobs = self._logprobs(out, new) if new else None
        if state.calls is None:
            return [
                ChatChunkChoice(
                    index=out.index,
                    delta=ChatDelta(content=out.delta_text),
                    finish_reason=out.finish_reason,
                    logprobs=logprobs,
                )
            ]
        calls = state.calls[out.index]
        text, done = calls.feed(out.delta_text)
        text += calls.finish() if out.finished else ""
        chunks = []
        for c in done:
            if state.tooling.single and state.sent[out.index]:
                continue
            call = ToolCallDelta(
                index=state.sent[out.index], id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)
            )
            chunks.append(
                ChatChunkChoice(index=out.index, delta=ChatDelta(content=None, tool_calls=[call]), finish_reason=None)
            )
            state.sent[out.index] += 1
        said = "tool_calls" if state.sent[out.index] and out.finish_reason == "stop" else out.finish_reason
        if text or out.finished or new:
            chunks.append(
                ChatChunkChoice(index=out.index, delta=ChatDelta(content=text), finish_reason=said, logprobs=logprobs)
            )
        return chunks
