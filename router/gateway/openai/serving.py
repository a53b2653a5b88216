"""What the OpenAI API's two generation endpoints share (``OpenAIServing``): reading and checking a body, running
the request (admission, sampling parameters, the tenant's pin, generation), answering it whole or as server-sent
events (usage on request), and the logprobs' token texts. ``/v1/chat/completions`` (router/gateway/openai/chat.py)
and ``/v1/completions`` (router/gateway/openai/completions.py) each supply their prompt, their reply and their
stream chunks; ``/{tenant}/v1/models`` is here."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

import secrets
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from common.defaults import DEFAULT_PIN_TTL_S
from common.outputs import RequestOutput, merge_choices
from router.gateway.chat import ChatPrompt
from router.gateway.core import Gateway
from router.gateway.errors import ApiError, err
from router.gateway.generation import GenerateRequest
from router.gateway.openai.protocol import (
    ChatChunkChoice,
    ChatCompletion,
    ChatRequest,
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
from router.gateway.runs import Run, primed, watched
from router.gateway.tenants import Slot, SlotStream, Tenant
from router.gateway.tools import Tooling
from router.gateway.wire import SseTemplate

API = "openai"
PROMPT_CACHE_24H_S = 24 * 3600.0  # prompt_cache_retention "24h"
INLINE_CELLS = 4096  # an answer of fewer tokens and alternatives is built on the event loop (a thread hop costs more)
LOGPROB_FLOOR = -9999.0  # what a log-probability of -inf (or NaN) is reported as: JSON has no infinity

routes = Routes()  # /v1/models, bound to one OpenAIServing by create_app

Choice = ChatChunkChoice | CompletionChunkChoice


def finite(lp: float) -> float:
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


class OpenAIServing:
    """The shared half of an OpenAI endpoint. A subclass sets ``ID_PREFIX`` and ``OBJECT`` (the reply id's prefix
    and the stream chunks' object) and builds its whole reply (``_whole``) and its stream chunks (``_opening``,
    ``_plain``, ``_choices`` over a ``_stream_state``)."""

    ID_PREFIX = ""
    OBJECT = ""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._local = threading.local()

    @property
    def token_texts(self) -> TokenTexts:
        """The calling thread's (a tokenizer is used by one thread only: ``Prompts.thread_tokenizer``)."""
        texts = getattr(self._local, "texts", None)
        if texts is None:
            texts = self._local.texts = TokenTexts(self.gw.prompts.thread_tokenizer())
        return texts

    @routes.get("/{tenant}/v1/models")
    async def models(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        base = self.gw.model_id
        adapters = [OpenAIModel(id=name, parent=base) for name in sorted(t.adapters)]
        return OpenAIModelList(data=[OpenAIModel(id=base), *adapters])

    async def _read(self, slot: Slot, request: Request, model: type[ChatRequest] | type[CompletionRequest]):
        """The request's body; its ``model`` is the base model or one of the tenant's adapters (kept on ``slot``)."""
        body = await self.gw.admission.body(request, model, API)
        self.gw.admission.pick_model(slot, body.model, API)
        refused = body.unsupported()
        if refused is not None:
            raise err(400, refused, API)
        return body

    async def _respond(
        self,
        slot: Slot,
        request: Request,
        body: ChatRequest | CompletionRequest,
        prompt: list[int],
        pin: int,
        ttl: float,
        max_tokens: int,
        tooling: Tooling,
        rendered: ChatPrompt | None = None,
    ):
        """Run the completion of ``prompt`` (its first ``pin`` tokens a cached content's, living ``ttl`` more) and
        answer it, streamed or whole. ``tooling``: a chat's tools and structured output (router/gateway/tools.py);
        ``rendered``: a chat's messages as the template rendered them."""
        gw, t = self.gw, slot.tenant
        await gw.admission.admit(slot, prompt, max_tokens * body.n, API, rendered)
        params = gw.prompts.params(
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
            gw.accounting.account(slot, out, predicted, gw.accounting.reported_cached(t, out.num_cached_tokens))

        req = GenerateRequest(
            t,
            prompt,
            params,
            API,
            pin,
            ttl or DEFAULT_PIN_TTL_S,
            account,
            restartable=not body.stream,
            n=body.n,
            cache_key=body.prompt_cache_key,
            adapter=None if slot.adapter is None else slot.adapter[1],
        )
        run = watched(request, gw.generation.generate(req), API)
        rid, created = self.ID_PREFIX + secrets.token_hex(12), int(time.time())
        if body.stream:
            usage_wanted = body.stream_options is not None and body.stream_options.include_usage
            run = await primed(run)  # errors before the first token still get their HTTP status
            return SlotStream(self._stream(t, run, rid, created, usage_wanted, body.n, tooling))
        outs = await finals(run)
        usage = self._usage(t, merge_choices(outs))
        # Built and serialised in the worker pool when large (n choices, logprobs: thousands of alternatives hold
        # the event loop for seconds).
        cells = sum(len(out.token_ids) for out in outs) * (1 if params.logprobs is None else 2 + params.logprobs)
        whole = (rid, created, usage, outs, tooling)
        return await gw.prompts.compute(t, self._response, *whole, inline=cells <= INLINE_CELLS)

    def _response(
        self, rid: str, created: int, usage: OpenAIUsage, outs: list[RequestOutput], tooling: Tooling
    ) -> Response:
        """A whole (not streamed) answer, as the JSON response."""
        return Response(_json(self._whole(rid, created, usage, outs, tooling)), media_type="application/json")

    def _usage(self, t: Tenant, out: RequestOutput) -> OpenAIUsage:
        """The request's usage, its cached tokens as the tenant's policy reports them."""
        cached = self.gw.accounting.reported_cached(t, out.num_cached_tokens)
        return OpenAIUsage.of(len(out.prompt_token_ids), len(out.token_ids), cached)

    async def _stream(
        self, t: Tenant, run: Run, rid: str, created: int, usage_wanted: bool, n: int, tooling: Tooling
    ) -> AsyncIterator[str]:
        def chunk(choice: Choice | None, usage: OpenAIUsage | None = None) -> str:
            return OpenAIChunk(
                id=rid,
                object=self.OBJECT,
                created=created,
                model=self.gw.model_id,
                choices=[] if choice is None else [choice],
                usage=usage,
            ).sse()

        def plain_chunk(index: int) -> SseTemplate:
            return SseTemplate(lambda x: chunk(self._plain(index, x)))

        try:
            for choice in self._opening(n):
                yield chunk(choice)
            lasts: dict[int, RequestOutput] = {}
            state = self._stream_state(n, tooling)
            plain: dict[int, SseTemplate] = {}  # per choice: a text chunk that is not the last, without logprobs
            async for out, _ in run:
                lasts[out.index] = out
                new = len(out.new_token_ids) if out.logprobs is not None else 0
                if not (out.delta_text or out.finished or new):
                    continue
                if not new and out.finish_reason is None and self._plain_ok(state):  # the common chunk: new text
                    fill = plain.get(out.index)
                    if fill is None:
                        fill = plain[out.index] = plain_chunk(out.index)
                    yield fill(out.delta_text)
                else:
                    for choice in self._choices(out, new, state):
                        yield chunk(choice)
            if lasts and usage_wanted:
                yield chunk(None, self._usage(t, merge_choices(list(lasts.values()))))
        except ApiError as exc:
            yield OpenAIStreamError(error=OpenAIStreamErrorDetail(message=exc.message, type=exc.kind)).sse()
        yield "data: [DONE]\n\n"

    # -- what each endpoint supplies ---------------------------------------------------------------------------

    def _logprobs_asked(self, body: Any) -> int | None:
        """The engine's ``SamplingParams.logprobs``: None (none), 0 (the chosen tokens') or how many of the most
        likely alternatives per token."""
        raise NotImplementedError

    def _whole(
        self, rid: str, created: int, usage: OpenAIUsage, outs: list[RequestOutput], tooling: Tooling
    ) -> ChatCompletion | TextCompletion:
        raise NotImplementedError

    def _opening(self, n: int) -> Sequence[Choice]:
        """The chunks a stream starts with, before any output."""
        return []

    def _stream_state(self, n: int, tooling: Tooling) -> Any:
        """What one stream keeps between its outputs."""
        return None

    def _plain_ok(self, state: Any) -> bool:
        """Whether an output of new text alone may be sent as ``_plain`` (filled into a template per token)."""
        return True

    def _plain(self, index: int, text: str) -> Choice:
        raise NotImplementedError

    def _choices(self, out: RequestOutput, new: int, state: Any) -> Sequence[Choice]:
        """The chunks of an output that is not plain text: with logprobs of ``new`` tokens, a finish, or tools."""
        raise NotImplementedError
