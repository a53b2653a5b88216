"""The OpenAI-compatible API of every tenant: ``/{tenant}/v1/models``, ``/v1/chat/completions`` and
``/v1/completions``, whole or streamed (server-sent events, usage on request). Its bodies are the models of
router/gateway/protocol.py; admission, routing and accounting are the ``Gateway``'s (router/gateway/core.py).

(Named ``openai_api`` rather than ``openai``, so that nothing importing the openai SDK can pick this up.)"""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

import secrets
import threading
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from common.defaults import DEFAULT_PIN_TTL_S
from common.outputs import RequestOutput, merge_choices
from router.gateway.chat import special_texts
from router.gateway.core import ApiError, Gateway, Run, SlotStream, Tenant, err, primed, watched
from router.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatLogprobs,
    ChatRequest,
    CompletionChoice,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCallOut,
    OpenAIChunk,
    OpenAIModel,
    OpenAIModelList,
    OpenAIStreamError,
    OpenAIStreamErrorDetail,
    OpenAIUsage,
    SseTemplate,
    TextCompletion,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)
from router.gateway.routes import Routes
from router.gateway.tools import CallStream, Tooling, openai_messages, openai_tooling, parse_calls, response_format

API = "openai"
DEFAULT_CHAT_MAX_TOKENS = 256
PROMPT_CACHE_24H_S = 24 * 3600.0  # prompt_cache_retention "24h"
INLINE_CELLS = 4096  # an answer of fewer tokens and alternatives is built on the event loop (a thread hop costs more)
LOGPROB_FLOOR = -9999.0  # what a log-probability of -inf (or NaN) is reported as: JSON has no infinity

routes = Routes()  # bound to one OpenAIApi by create_app


def _finite(lp: float) -> float:
    return lp if lp > LOGPROB_FLOOR else LOGPROB_FLOOR


def _byte_chars() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): byte -> the printable character a token's text uses for it.
    Printable Latin-1 bytes stand for themselves; the others map to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class TokenTexts:
    """A token id's text and exact UTF-8 bytes, as the logprobs of the OpenAI APIs show them (memoized). With a
    byte-level BPE tokenizer the bytes are the token's own, also when it holds only part of a character (its text
    then shows U+FFFD); special and added tokens are their content."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.unbyte = {c: b for b, c in _byte_chars().items()}
        self.added = set(tokenizer.get_added_vocab().values())
        self._memo: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._memo.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self.byte_level and token_id not in self.added and all(ch in self.unbyte for ch in piece):
            raw = bytes(self.unbyte[ch] for ch in piece)
        else:
            raw = self.tokenizer.decode([token_id]).encode()
        hit = self._memo[token_id] = (raw.decode("utf-8", "replace"), list(raw))
        return hit


def _tooling(body: ChatRequest, specials: tuple[str, ...]) -> Tooling:
    return openai_tooling(body, response_format(body.response_format, specials), specials)


def _json(reply: ChatCompletion | TextCompletion) -> bytes:
    """``reply.model_dump_json()``, a choice at a time: serialising holds the GIL, and so the event loop, throughout
    (half a second for one 40 MB answer), a choice's only for milliseconds."""
    head = reply.model_copy(update={"choices": []}).model_dump_json()
    at = head.index('"choices":[]') + len('"choices":[')  # the key (in a string value its quotes are escaped)
    choices = ",".join(choice.model_dump_json() for choice in reply.choices)
    return f"{head[:at]}{choices}{head[at:]}".encode()


async def finals(run: Run) -> list[RequestOutput]:
    """The last output of each of a request's choices, in index order."""
    lasts: dict[int, RequestOutput] = {}
    async for out, _ in run:
        lasts[out.index] = out
    return [lasts[i] for i in sorted(lasts)]


class OpenAIApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._local = threading.local()

    @property
    def token_texts(self) -> TokenTexts:
        """The calling thread's (a tokenizer is used by one thread only: ``Gateway.thread_tokenizer``)."""
        texts = getattr(self._local, "texts", None)
        if texts is None:
            texts = self._local.texts = TokenTexts(self.gw.thread_tokenizer())
        return texts

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
        refused = body.unsupported()
        if refused is not None:
            raise err(400, refused, API)
        return body

    async def _chat_completions(self, t: Tenant, request: Request):
        gw = self.gw
        body: ChatRequest = await self._read(request, ChatRequest)
        try:
            messages = openai_messages(body.messages)
            specials = special_texts(gw.tokenizer)
            schemas = bool(body.tools) or body.response_format is not None  # compiled to check them: off the loop
            tooling = await gw.compute(t, _tooling, body, specials, inline=not schemas)
        except ValueError as exc:
            raise err(400, str(exc), API) from None
        prefix, ttl = await gw.cached_prefix(t, body.cached_content, API)
        prompt = prefix + (await gw.chat(t, messages, API, tools=tooling.template)).token_ids
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        if body.max_completion_tokens or body.max_tokens:  # asked for: refused if it does not fit, never capped
            field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            gw.check_context(prompt, max_tokens, field, API)
        return await self._respond(t, request, body, prompt, len(prefix), ttl, max_tokens, chat=True, tooling=tooling)

    @routes.post("/{tenant}/v1/completions")
    async def completions(self, tenant: str, request: Request):
        t = self.gw.auth(tenant, request, API)
        return await self.gw.held(t, API, self._completions(t, request))

    async def _completions(self, t: Tenant, request: Request):
        gw = self.gw
        body: CompletionRequest = await self._read(request, CompletionRequest)
        prefix, ttl = await gw.cached_prefix(t, body.cached_content, API)
        tokens = await gw.encode_text(t, body.prompt, API) if isinstance(body.prompt, str) else list(body.prompt)
        if tokens and not (0 <= min(tokens) and max(tokens) < gw.vocab_size):
            raise err(400, "prompt: token id outside the vocabulary", API)
        if "max_tokens" in body.model_fields_set:  # the default (16) is capped by the engine instead
            gw.check_context(prefix + tokens, body.max_tokens, "max_tokens", API)
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
        tooling: Tooling | None = None,
    ):
        """Run a chat or text completion and answer it, streamed or whole. ``tooling``: a chat's tools and
        structured output (router/gateway/tools.py)."""
        gw = self.gw
        tooling = tooling or Tooling()
        await gw.admit(t, prompt, max_tokens * body.n, API)
        params = gw.params(
            max_tokens,
            body.temperature,
            body.top_p,
            body.stop,
            body.seed,
            API,
            body.top_k,
            ignore_eos=body.ignore_eos,
            structured_output=tooling.structured,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            stop_token_ids=body.stop_token_ids,
        )
        params.logprobs = self._logprobs_asked(body)  # bounded by the request model (at most MAX_LOGPROBS)
        if body.prompt_cache_retention == "24h":  # the prompt's blocks stay pinned, within the tenant's pin limits
            pin, ttl = len(prompt), max(ttl, PROMPT_CACHE_24H_S)

        def account(out: RequestOutput, predicted: int) -> None:
            gw.account(t, out, predicted, gw.reported_cached(t, out.num_cached_tokens))

        run = gw.generate(
            t,
            prompt,
            params,
            API,
            pin,
            ttl or DEFAULT_PIN_TTL_S,
            account,
            not body.stream,
            n=body.n,
            cache_key=body.prompt_cache_key,
        )
        run = watched(request, run, API)
        rid, created = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), int(time.time())
        if body.stream:
            usage_wanted = body.stream_options is not None and body.stream_options.include_usage
            run = await primed(run)  # errors before the first token still get their HTTP status
            return SlotStream(self._stream(t, run, rid, created, usage_wanted, chat, body.n, tooling))
        outs = await finals(run)
        usage = self._usage(t, merge_choices(outs))
        # Built and serialised in the worker pool when large (n choices, logprobs: 64 choices of 100 tokens with 20
        # alternatives each held the event loop for 3.7 s).
        cells = sum(len(out.token_ids) for out in outs) * (1 if params.logprobs is None else 2 + params.logprobs)
        return await gw.compute(t, self._whole, rid, created, usage, outs, chat, tooling, inline=cells <= INLINE_CELLS)

    def _whole(
        self,
        rid: str,
        created: int,
        usage: OpenAIUsage,
        outs: list[RequestOutput],
        chat: bool,
        tooling: Tooling,
    ) -> Response:
        """A whole (not streamed) answer, as the JSON response."""
        reply: ChatCompletion | TextCompletion
        if chat:
            reply = ChatCompletion(
                id=rid,
                created=created,
                model=self.gw.model_id,
                usage=usage,
                choices=[
                    ChatChoice(
                        index=out.index,
                        message=message,
                        finish_reason="tool_calls" if message.tool_calls else out.finish_reason,
                        logprobs=self._chat_logprobs(out, len(out.token_ids)),
                    )
                    for out in outs
                    for message in [self._message(out, tooling)]
                ],
            )
        else:
            reply = TextCompletion(
                id=rid,
                created=created,
                model=self.gw.model_id,
                usage=usage,
                choices=[
                    CompletionChoice(
                        index=out.index,
                        text=out.text,
                        finish_reason=out.finish_reason,
                        logprobs=self._completion_logprobs(out, len(out.token_ids), 0),
                    )
                    for out in outs
                ],
            )
        return Response(_json(reply), media_type="application/json")

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

    @staticmethod
    def _logprobs_asked(body: ChatRequest | CompletionRequest) -> int | None:
        """The engine's ``SamplingParams.logprobs``: None (none), 0 (the chosen tokens') or how many of the
        most likely alternatives per token."""
        if isinstance(body, ChatRequest):
            return (body.top_logprobs or 0) if body.logprobs else None
        return body.logprobs

    def _chat_logprobs(self, out: RequestOutput, num_new: int) -> ChatLogprobs | None:
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
                    logprob=_finite(out.logprobs[i]),
                    bytes=raw,
                    top_logprobs=[
                        TopLogprob(token=(alt := texts(tid))[0], logprob=_finite(lp), bytes=alt[1]) for tid, lp in alts
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, out: RequestOutput, num_new: int, offset: int) -> CompletionLogprobs | None:
        """The legacy completions shape of the logprobs of ``out``'s last ``num_new`` tokens, their text offsets
        counted from ``offset`` (None when not asked for)."""
        if out.logprobs is None:
            return None
        texts, start = self.token_texts, len(out.token_ids) - num_new
        tops = out.top_logprobs or []
        lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i in range(start, len(out.token_ids)):
            token = texts(out.token_ids[i])[0]
            lp.tokens.append(token)
            lp.token_logprobs.append(_finite(out.logprobs[i]))
            top = {texts(tid)[0]: _finite(v) for tid, v in (tops[i].items() if i < len(tops) else ())}
            top[token] = _finite(out.logprobs[i])  # the chosen token is always among them, as in OpenAI's API
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(token)
        return lp

    def _usage(self, t: Tenant, out: RequestOutput) -> OpenAIUsage:
        """The request's usage, its cached tokens as the tenant's policy reports them."""
        return OpenAIUsage.of(
            len(out.prompt_token_ids), len(out.token_ids), self.gw.reported_cached(t, out.num_cached_tokens)
        )

    async def _stream(
        self,
        t: Tenant,
        run: Run,
        rid: str,
        created: int,
        usage_wanted: bool,
        chat: bool,
        n: int = 1,
        tooling: Tooling | None = None,
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        # Chat with tools: each choice's text goes through a CallStream; a call is sent once it is complete.
        calls = [CallStream("call_") for _ in range(n)] if chat and tooling is not None and tooling.parse else None
        num_calls = [0] * n

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
                for i in range(n):
                    yield chunk(
                        ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), finish_reason=None)
                    )
            lasts: dict[int, RequestOutput] = {}
            offsets = [0] * n  # completions: text offset of each choice's next token
            plain: dict[int, SseTemplate] = {}  # per choice: a text chunk that is not the last, without logprobs

            def text_chunk(index: int, text: str) -> str:
                fill = plain.get(index)
                if fill is None:

                    def choice(x: str) -> ChatChunkChoice | CompletionChunkChoice:
                        if chat:
                            return ChatChunkChoice(index=index, delta=ChatDelta(content=x), finish_reason=None)
                        return CompletionChunkChoice(index=index, text=x, finish_reason=None)

                    fill = plain[index] = SseTemplate(lambda x: chunk(choice(x)))
                return fill(text)

            async for out, _ in run:
                lasts[out.index] = out
                new = len(out.new_token_ids) if out.logprobs is not None else 0
                if out.delta_text or out.finished or new:
                    reason = out.finish_reason
                    if chat and calls is not None:
                        assert tooling is not None
                        text, done = calls[out.index].feed(out.delta_text)
                        text += calls[out.index].finish() if out.finished else ""
                        for c in done:
                            if tooling.single and num_calls[out.index]:
                                continue
                            yield chunk(
                                ChatChunkChoice(
                                    index=out.index,
                                    delta=ChatDelta(
                                        content=None,
                                        tool_calls=[
                                            ToolCallDelta(
                                                index=num_calls[out.index],
                                                id=c.id,
                                                function=FunctionCallOut(name=c.name, arguments=c.arguments),
                                            )
                                        ],
                                    ),
                                    finish_reason=None,
                                )
                            )
                            num_calls[out.index] += 1
                        said = "tool_calls" if num_calls[out.index] and reason == "stop" else reason
                        if text or out.finished or new:
                            yield chunk(
                                ChatChunkChoice(
                                    index=out.index,
                                    delta=ChatDelta(content=text),
                                    finish_reason=said,
                                    logprobs=self._chat_logprobs(out, new) if new else None,
                                )
                            )
                    elif not new and reason is None:  # the common chunk: new text only
                        yield text_chunk(out.index, out.delta_text)
                    elif chat:
                        yield chunk(
                            ChatChunkChoice(
                                index=out.index,
                                delta=ChatDelta(content=out.delta_text),
                                finish_reason=reason,
                                logprobs=self._chat_logprobs(out, new) if new else None,
                            )
                        )
                    else:
                        lp = self._completion_logprobs(out, new, offsets[out.index]) if new else None
                        if lp is not None and lp.tokens:
                            offsets[out.index] = lp.text_offset[-1] + len(lp.tokens[-1])
                        yield chunk(
                            CompletionChunkChoice(
                                index=out.index, text=out.delta_text, finish_reason=reason, logprobs=lp
                            )
                        )
            if lasts and usage_wanted:
                yield chunk(None, self._usage(t, merge_choices(list(lasts.values()))))
        except ApiError as exc:
            yield OpenAIStreamError(error=OpenAIStreamErrorDetail(message=exc.message, type=exc.kind)).sse()
        yield "data: [DONE]\n\n"
