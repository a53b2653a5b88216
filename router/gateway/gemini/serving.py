"""The Gemini API of every tenant, as the ``google-genai`` SDK calls it (``api_version="v1beta"``, the tenant's
path as the base URL, its key in ``x-goog-api-key``):

    GET    /{tenant}/v1beta/models, /models/{model}
    POST   /{tenant}/v1beta/models/{model}:generateContent        whole answer
    POST   /{tenant}/v1beta/models/{model}:streamGenerateContent  server-sent events (``?alt=sse``)
    POST   /{tenant}/v1beta/models/{model}:countTokens
    POST   /{tenant}/v1beta/cachedContents                         create (computed and pinned on a group)
    GET    /{tenant}/v1beta/cachedContents[/{id}]                  list (``pageSize``, ``pageToken``) / get
    PATCH  /{tenant}/v1beta/cachedContents/{id}                    a new ``ttl`` or ``expireTime`` (re-pinned)
    DELETE /{tenant}/v1beta/cachedContents/{id}

A cached content holds a system instruction and contents; a ``generateContent`` that names it in
``cachedContent`` starts with its tokens, so the group that pinned them reuses them, and
``usageMetadata.cachedContentTokenCount`` is what the group actually reused (left out when nothing was). The
objects are the tenant's cached contents of router/gateway/gemini/cached_contents.py (one store, limits and code), in
Gemini's shape. Errors are Gemini's (``{"error": {"code", "message", "status"}}``).

What the engine does not do is refused by name (400) rather than ignored: ``tools``, ``toolConfig``, a
``responseMimeType`` other than ``text/plain``, response schemas, penalties, logprobs, ``candidateCount`` > 1,
thinking, non-text modalities and parts."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

import secrets
import time
from collections.abc import AsyncIterator
from datetime import datetime

from fastapi import Request
from fastapi.responses import JSONResponse

from common.defaults import DEFAULT_PIN_TTL_S
from common.outputs import FinishReason, RequestOutput
from common.sampling import SamplingParams
from router.gateway.chat import ChatPrompt
from router.gateway.core import Gateway
from router.gateway.errors import ApiError, err
from router.gateway.gemini.cached_contents import MAX_CACHED_CONTENT_TTL_S, create_content, renew_content
from router.gateway.gemini.protocol import (
    CountTokensReply,
    CountTokensRequest,
    GeminiCachedContentList,
    GeminiCachedContentPatch,
    GeminiCachedContentReply,
    GeminiCachedContentRequest,
    GeminiCandidate,
    GeminiContent,
    GeminiGenerationConfig,
    GeminiReplyContent,
    GeminiTextPart,
    GeminiUsage,
    GenerateContentReply,
    GenerateContentRequest,
    UsageMetadata,
)
from router.gateway.generation import GenerateRequest
from router.gateway.routes import Routes
from router.gateway.runs import Run, last, primed, watched
from router.gateway.store import CachedContent, rfc3339
from router.gateway.tenants import Slot, SlotStream, Tenant

API = "gemini"
DEFAULT_MAX_OUTPUT_TOKENS = 256
MAX_PAGE_SIZE = 1000
_FINISH = {FinishReason.STOP: "STOP", FinishReason.LENGTH: "MAX_TOKENS"}


def _finish(out: RequestOutput) -> str:
    return _FINISH.get(out.finish_reason, "OTHER") if out.finish_reason is not None else "OTHER"


routes = Routes()  # bound to one GeminiApi by create_app


def _messages(contents: list[GeminiContent], system: GeminiContent | None, field: str) -> list[dict[str, str]]:
    """Gemini contents as chat messages: the system instruction first, ``user`` and ``model`` turns."""
    out = [{"role": "system", "content": system.text}] if system is not None else []
    for i, c in enumerate(contents):
        role = c.role or "user"
        if role not in ("user", "model"):
            raise err(400, f"{field}.{i}.role must be 'user' or 'model', got {role!r}", API)
        out.append({"role": "assistant" if role == "model" else "user", "content": c.text})
    return out


def _refuse_unsupported(body: GenerateContentRequest | GeminiCachedContentRequest) -> None:
    for name in ("tools", "toolConfig"):
        if getattr(body, name) is not None:
            raise err(400, f"{name}: function calling is not served through the Gemini API here", API)


def _check_config(g: GeminiGenerationConfig) -> None:
    if g.responseMimeType not in (None, "text/plain"):
        raise err(400, f"generationConfig.responseMimeType: only text/plain is served, got {g.responseMimeType!r}", API)
    unsupported = {
        "responseSchema": g.responseSchema,
        "responseJsonSchema": g.responseJsonSchema,
        "presencePenalty": g.presencePenalty,
        "frequencyPenalty": g.frequencyPenalty,
        "responseLogprobs": g.responseLogprobs or None,
        "logprobs": g.logprobs,
        "thinkingConfig": g.thinkingConfig,
    }
    for name, value in unsupported.items():
        if value is not None:
            raise err(400, f"generationConfig.{name} is not supported by this server", API)
    if g.responseModalities is not None and [m.upper() for m in g.responseModalities] != ["TEXT"]:
        raise err(400, "generationConfig.responseModalities: only TEXT is served", API)
    if g.candidateCount not in (None, 1):
        raise err(400, "generationConfig.candidateCount: one candidate per request is served", API)
    if g.topK is not None and g.topK != int(g.topK):
        raise err(400, "generationConfig.topK must be a whole number", API)


def _lifetime(gw: Gateway, t: Tenant, ttl: str | None, expire_time: str | None) -> float:
    """Seconds from now that a cached content should live: ``ttl`` (``"300s"``) or ``expireTime`` (RFC 3339)."""
    if ttl is not None and expire_time is not None:
        raise err(400, "give either ttl or expireTime, not both", API)
    if expire_time is not None:
        try:
            when = datetime.fromisoformat(expire_time).timestamp()
        except ValueError:
            raise err(400, f"expireTime: {expire_time!r} is not an RFC 3339 time", API) from None
        seconds = when - time.time()
        if not 1.0 <= seconds <= MAX_CACHED_CONTENT_TTL_S:
            raise err(400, f"expireTime must be between 1s and {MAX_CACHED_CONTENT_TTL_S:.0f}s from now", API)
        return seconds
    return gw.admission.ttl(ttl, t.config.cache.default_ttl, MAX_CACHED_CONTENT_TTL_S, "ttl", API)


class GeminiApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    # -- models -------------------------------------------------------------------------------------------------

    def _model(self, name: str | None = None) -> dict:
        """The base model's description, or that of the tenant's adapter ``name`` (generation only)."""
        gw = self.gw
        name = name or gw.model_id
        methods = ["generateContent", "countTokens", "createCachedContent"]
        return {
            "name": f"models/{name}",
            "displayName": name,
            "baseModelId": gw.model_id,
            "inputTokenLimit": gw.max_model_len,
            "outputTokenLimit": gw.max_model_len,
            "supportedGenerationMethods": methods if name == gw.model_id else methods[:2],
        }

    @routes.get("/{tenant}/v1beta/models")
    async def list_models(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return JSONResponse({"models": [self._model(), *(self._model(name) for name in sorted(t.adapters))]})

    @routes.get("/{tenant}/v1beta/models/{model}")
    async def get_model(self, tenant: str, model: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        self.gw.admission.model_ref(t, model, API)
        return JSONResponse(self._model(model))

    # -- generateContent ----------------------------------------------------------------------------------------

    @routes.post("/{tenant}/v1beta/models/{model}:generateContent")
    async def generate_content(self, tenant: str, model: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._generate(slot, model, request, stream=False))

    @routes.post("/{tenant}/v1beta/models/{model}:streamGenerateContent")
    async def stream_generate_content(self, tenant: str, model: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._generate(slot, model, request, stream=True))

    async def _prompt(
        self, t: Tenant, model: str, body: GenerateContentRequest
    ) -> tuple[list[int], int, float, ChatPrompt]:
        """The request's prompt tokens, how many of them are its cached content's, that content's TTL left, and
        the rendered chat after it."""
        gw = self.gw
        gw.admission.model_ref(t, model, API)  # the base model or one of the tenant's adapters
        _refuse_unsupported(body)
        _check_config(body.generationConfig)
        if body.cachedContent is not None and body.systemInstruction is not None:
            raise err(400, "systemInstruction: a request with cachedContent takes the cached content's", API)
        prefix, ttl = await gw.prompts.cached_prefix(t, body.cachedContent, API)
        chat = await gw.prompts.chat(t, _messages(body.contents, body.systemInstruction, "contents"), API)
        return prefix + chat.token_ids, len(prefix), ttl, chat

    def _params(self, g: GeminiGenerationConfig) -> SamplingParams:
        return self.gw.prompts.params(
            g.maxOutputTokens or DEFAULT_MAX_OUTPUT_TOKENS,
            1.0 if g.temperature is None else g.temperature,
            1.0 if g.topP is None else g.topP,
            g.stopSequences,
            g.seed,
            API,
            0 if g.topK is None else int(g.topK),
        )

    async def _generate(self, slot: Slot, model: str, request: Request, stream: bool):
        gw, t = self.gw, slot.tenant
        body: GenerateContentRequest = await gw.admission.body(request, GenerateContentRequest, API)
        adapter = gw.admission.pick_model(slot, model, API)
        prompt, pin, ttl, chat = await self._prompt(t, model, body)
        params = self._params(body.generationConfig)
        if body.generationConfig.maxOutputTokens is not None:  # asked for: refused if it does not fit
            gw.admission.check_context(prompt, params.max_tokens, "generationConfig.maxOutputTokens", API)
        await gw.admission.admit(slot, prompt, params.max_tokens, API, chat)

        def account(out: RequestOutput, predicted: int) -> None:
            gw.accounting.account(slot, out, predicted, gw.accounting.reported_cached(t, out.num_cached_tokens))

        req = GenerateRequest(
            t, prompt, params, API, pin, ttl or DEFAULT_PIN_TTL_S, account, restartable=not stream, adapter=adapter
        )
        run = gw.generation.generate(req)
        run = watched(request, run, API)
        rid = secrets.token_hex(12)
        if stream:
            run = await primed(run)  # errors before the first token still get their HTTP status
            return SlotStream(self._stream(t, run, rid))
        out, _ = await last(run)
        return self._reply(t, out, rid, out.text, _finish(out))

    def _usage(self, t: Tenant, out: RequestOutput) -> GeminiUsage:
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        cached = self.gw.accounting.reported_cached(t, out.num_cached_tokens)
        return GeminiUsage(
            promptTokenCount=n_prompt,
            candidatesTokenCount=n_out,
            totalTokenCount=n_prompt + n_out,
            cachedContentTokenCount=cached or None,
        )

    def _reply(self, t: Tenant, out: RequestOutput, rid: str, text: str, finish: str | None) -> GenerateContentReply:
        return GenerateContentReply(
            candidates=[
                GeminiCandidate(
                    content=GeminiReplyContent(parts=[GeminiTextPart(text=text)]),
                    finishReason=finish,
                )
            ],
            usageMetadata=self._usage(t, out),
            modelVersion=self.gw.model_id,
            responseId=rid,
        )

    async def _stream(self, t: Tenant, run: Run, rid: str) -> AsyncIterator[str]:
        try:
            async for out, _ in run:
                if out.delta_text or out.finished:
                    yield self._reply(t, out, rid, out.delta_text, _finish(out) if out.finished else None).sse()
        except ApiError as exc:  # after the first event the status is sent: the error is the stream's last event
            yield f"data: {exc.body().model_dump_json()}\n\n"

    # -- countTokens --------------------------------------------------------------------------------------------

    @routes.post("/{tenant}/v1beta/models/{model}:countTokens")
    async def count_tokens(self, tenant: str, model: str, request: Request):
        """A request like any other: within the tenant's in-flight places, request rate and prompt size (413)."""
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda _: self._count_tokens(t, model, request))

    async def _count_tokens(self, t: Tenant, model: str, request: Request):
        gw = self.gw
        await gw.admission.admit_request(t, API)
        body: CountTokensRequest = await gw.admission.body(request, CountTokensRequest, API)
        if body.generateContentRequest is not None:
            prompt, cached, _, _ = await self._prompt(t, model, body.generateContentRequest)
        elif body.contents:
            gw.admission.model_ref(t, model, API)
            prompt, cached = (await gw.prompts.chat(t, _messages(body.contents, None, "contents"), API)).token_ids, 0
        else:
            raise err(400, "contents: give contents or a generateContentRequest to count", API)
        gw.admission.check_size(t, len(prompt), 0, API)
        return CountTokensReply(totalTokens=len(prompt), cachedContentTokenCount=cached or None)

    # -- cached contents ----------------------------------------------------------------------------------------

    def _public(self, cc: CachedContent) -> GeminiCachedContentReply:
        return GeminiCachedContentReply(
            name=cc.id,
            model=cc.content.get("model", f"models/{self.gw.model_id}"),
            displayName=cc.content.get("displayName"),
            createTime=rfc3339(cc.created),
            updateTime=rfc3339(cc.updated or cc.created),
            expireTime=rfc3339(cc.expires),
            usageMetadata=UsageMetadata(totalTokenCount=len(cc.token_ids)),
        )

    @routes.post("/{tenant}/v1beta/cachedContents")
    async def create_cached_content(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._create(slot, request))

    async def _create(self, slot: Slot, request: Request):
        gw, t = self.gw, slot.tenant
        body: GeminiCachedContentRequest = await gw.admission.body(request, GeminiCachedContentRequest, API)
        gw.admission.check_model(body.model.removeprefix("models/"), API)
        _refuse_unsupported(body)
        messages = _messages(body.contents or [], body.systemInstruction, "contents")
        if not any(m["content"] for m in messages):
            raise err(400, "contents: a cached content needs a system instruction or contents with text", API)
        ttl = _lifetime(gw, t, body.ttl, body.expireTime)
        chat = await gw.prompts.chat(t, messages, API, generation=False)
        meta = {"model": f"models/{gw.model_id}", "displayName": body.displayName}
        return self._public(await create_content(gw, slot, meta, chat, ttl, request, API))

    @routes.get("/{tenant}/v1beta/cachedContents")
    async def list_cached_contents(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        q = request.query_params
        try:
            size = int(q.get("pageSize") or 100)
            start = int(q.get("pageToken") or 0)
        except ValueError:
            raise err(400, "pageSize and pageToken must be the numbers this API gave", API) from None
        if not 1 <= size <= MAX_PAGE_SIZE or start < 0:
            raise err(400, f"pageSize must be in 1..{MAX_PAGE_SIZE}, pageToken one this API gave", API)
        items = await self.gw.contents[t.name].list(t.name)
        page = items[start : start + size]
        more = start + size < len(items)
        return GeminiCachedContentList(
            cachedContents=[self._public(c) for c in page], nextPageToken=str(start + size) if more else None
        )

    @routes.get("/{tenant}/v1beta/cachedContents/{cid}")
    async def get_cached_content(self, tenant: str, cid: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        cc = await self.gw.contents[t.name].get(t.name, f"cachedContents/{cid}")
        if cc is None:
            raise err(404, f"cached content {cid!r} not found", API)
        return self._public(cc)

    @routes.patch("/{tenant}/v1beta/cachedContents/{cid}")
    async def update_cached_content(self, tenant: str, cid: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._update(slot, cid, request))

    async def _update(self, slot: Slot, cid: str, request: Request):
        gw, t = self.gw, slot.tenant
        body: GeminiCachedContentPatch = await gw.admission.body(request, GeminiCachedContentPatch, API)
        mask = {m.strip() for m in (request.query_params.get("updateMask") or "").split(",") if m.strip()}
        if mask - {"ttl", "expireTime", "expire_time"}:
            raise err(400, f"updateMask: only ttl or expireTime can be updated, got {sorted(mask)}", API)
        if body.ttl is None and body.expireTime is None:
            raise err(400, "ttl: give a new ttl or expireTime", API)
        ttl = _lifetime(gw, t, body.ttl, body.expireTime)
        return self._public(await renew_content(gw, slot, cid, ttl, request, API))

    @routes.delete("/{tenant}/v1beta/cachedContents/{cid}")
    async def delete_cached_content(self, tenant: str, cid: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        if not await self.gw.contents[t.name].delete(t.name, f"cachedContents/{cid}"):
            raise err(404, f"cached content {cid!r} not found", API)
        return JSONResponse({})
