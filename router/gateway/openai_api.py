"""The OpenAI-compatible API of every tenant: ``/{tenant}/v1/models``, ``/v1/chat/completions`` and
``/v1/completions``, whole or streamed (server-sent events, usage on request). Its bodies are the models of
router/gateway/protocol.py; admission, routing and accounting are the ``Gateway``'s (router/gateway/core.py).

(Named ``openai_api`` rather than ``openai``, so that nothing importing the openai SDK can pick this up.)"""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

import secrets
import time
from collections.abc import AsyncIterator

from fastapi import Request

from common.outputs import RequestOutput
from router.gateway.core import ApiError, Gateway, Run, SlotStream, Tenant, err, last, primed, watched
from router.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatRequest,
    CompletionChoice,
    CompletionChunkChoice,
    CompletionRequest,
    OpenAIChunk,
    OpenAIModel,
    OpenAIModelList,
    OpenAIStreamError,
    OpenAIStreamErrorDetail,
    OpenAIUsage,
    TextCompletion,
)
from router.gateway.routes import Routes

API = "openai"
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_PIN_TTL_S = 300.0  # how long the part of a prompt that is a cached content stays pinned, at least

routes = Routes()  # bound to one OpenAIApi by create_app


class OpenAIApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    @routes.get("/{tenant}/v1/models")
    async def models(self, tenant: str, request: Request):
        self.gw.auth(tenant, request, API)
        return OpenAIModelList(data=[OpenAIModel(id=self.gw.model_id)])

    @routes.post("/{tenant}/v1/chat/completions")
    async def chat_completions(self, tenant: str, request: Request):
        t = self.gw.auth(tenant, request, API)
        return await self.gw.held(t, API, self._chat_completions(t, request))

    async def _read(self, request: Request, model: type[ChatRequest] | type[CompletionRequest]):
        body = await self.gw.body(request, model, API)
        self.gw.check_model(body.model, API)
        if body.n != 1:
            raise err(400, "n must be 1", API)
        return body

    async def _chat_completions(self, t: Tenant, request: Request):
        gw = self.gw
        body: ChatRequest = await self._read(request, ChatRequest)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in body.messages]
        prefix, ttl = await gw.cached_prefix(t, body.cached_content, API)
        prompt = prefix + gw.chat(messages, API).token_ids
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        return await self._respond(t, request, body, prompt, len(prefix), ttl, max_tokens, chat=True)

    @routes.post("/{tenant}/v1/completions")
    async def completions(self, tenant: str, request: Request):
        t = self.gw.auth(tenant, request, API)
        return await self.gw.held(t, API, self._completions(t, request))

    async def _completions(self, t: Tenant, request: Request):
        gw = self.gw
        body: CompletionRequest = await self._read(request, CompletionRequest)
        prefix, ttl = await gw.cached_prefix(t, body.cached_content, API)
        tokens = gw.encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if any(not 0 <= tok < len(gw.tokenizer) for tok in tokens):
            raise err(400, "prompt: token id outside the vocabulary", API)
        return await self._respond(t, request, body, prefix + tokens, len(prefix), ttl, body.max_tokens, chat=False)

    async def _respond(
        self,
        t: Tenant,
        request: Request,
        body: ChatRequest | CompletionRequest,
        prompt: list[int],
        pin: int,
        ttl: float,
        max_tokens: int,
        chat: bool,
    ):
        """Run a chat or text completion and answer it, streamed or whole."""
        gw = self.gw
        await gw.admit(t, prompt, max_tokens, API)
        params = gw.params(
            max_tokens, body.temperature, body.top_p, body.stop, body.seed, API, ignore_eos=body.ignore_eos
        )

        def account(out: RequestOutput, predicted: int) -> None:
            gw.account(t, out, predicted, gw.reported_cached(t, out.num_cached_tokens))

        run = gw.generate(t, prompt, params, API, pin, ttl or DEFAULT_PIN_TTL_S, account, not body.stream)
        run = watched(request, run, API)
        rid, created = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), int(time.time())
        if body.stream:
            usage_wanted = body.stream_options is not None and body.stream_options.include_usage
            run = await primed(run)  # errors before the first token still get their HTTP status
            return SlotStream(self._stream(t, run, rid, created, usage_wanted, chat))
        out, _ = await last(run)
        usage = self._usage(t, out)
        if chat:
            return ChatCompletion(
                id=rid,
                created=created,
                model=gw.model_id,
                usage=usage,
                choices=[ChatChoice(message=AssistantMessage(content=out.text), finish_reason=out.finish_reason)],
            )
        return TextCompletion(
            id=rid,
            created=created,
            model=gw.model_id,
            usage=usage,
            choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)],
        )

    def _usage(self, t: Tenant, out: RequestOutput) -> OpenAIUsage:
        """The request's usage, its cached tokens as the tenant's policy reports them."""
        return OpenAIUsage.of(
            len(out.prompt_token_ids), len(out.token_ids), self.gw.reported_cached(t, out.num_cached_tokens)
        )

    async def _stream(
        self, t: Tenant, run: Run, rid: str, created: int, usage_wanted: bool, chat: bool
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: ChatChunkChoice | CompletionChunkChoice | None, usage: OpenAIUsage | None = None) -> str:
            return OpenAIChunk(
                id=rid,
                object=obj,
                created=created,
                model=self.gw.model_id,
                choices=[] if choice is None else [choice],
                usage=usage,
            ).sse()

        try:
            if chat:
                yield chunk(ChatChunkChoice(delta=ChatDelta(role="assistant", content=""), finish_reason=None))
            out = None
            async for out, _ in run:
                if out.delta_text or out.finished:
                    reason = out.finish_reason
                    yield chunk(
                        ChatChunkChoice(delta=ChatDelta(content=out.delta_text), finish_reason=reason)
                        if chat
                        else CompletionChunkChoice(text=out.delta_text, finish_reason=reason)
                    )
            if out is not None and usage_wanted:
                yield chunk(None, self._usage(t, out))
        except ApiError as exc:
            yield OpenAIStreamError(error=OpenAIStreamErrorDetail(message=exc.message, type=exc.kind)).sse()
        yield "data: [DONE]\n\n"
