"""Cached content objects of every tenant (Gemini's shape), under ``/{tenant}/v1/cachedContents``: a text
computed and pinned on a worker group once (billed like a request), listed, read, given a new lifetime, deleted,
and used as the prefix of any request that names it in ``cached_content``. Stored in Redis
(``CachedContentStore``); errors in the OpenAI format. ``create_content`` and ``renew_content`` are also the
Gemini API's (router/gateway/gemini/serving.py): one implementation for both."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

from fastapi import Request
from fastapi.responses import JSONResponse

from common.sampling import SamplingParams
from router.gateway.chat import ChatPrompt
from router.gateway.core import Gateway
from router.gateway.errors import err
from router.gateway.gemini.protocol import CachedContentList, CachedContentPatch, CachedContentRequest
from router.gateway.generation import GenerateRequest
from router.gateway.routes import Routes
from router.gateway.runs import last, watched
from router.gateway.store import CachedContent, LimitExceeded
from router.gateway.tenants import Slot, Tenant

API = "openai"  # the format of the errors
MAX_CACHED_CONTENT_TTL_S = 7 * 24 * 3600.0
LIMIT_RETRY_AFTER_S = 60.0  # a tenant at its number or size of cached contents

routes = Routes()  # bound to one CachedContentsApi by create_app


async def pin_content(gw: Gateway, slot: Slot, tokens: list[int], ttl: float, request: Request, api: str) -> None:
    """Compute and pin a cached content's tokens for ``ttl`` on a group, billed like a request: the prompt
    tokens, what was reused (a read) and what was computed and pinned (a write). Stopped if the client leaves."""
    t = slot.tenant
    params = SamplingParams(max_tokens=1, temperature=0.0)
    run = gw.generation.generate(GenerateRequest(t, tokens, params, api, len(tokens), ttl, restartable=True))
    out, predicted = await last(watched(request, run, api))
    read = min(out.num_cached_tokens, len(tokens))
    gw.accounting.account(slot, out, predicted, read, write=len(tokens) - read, read=read, write_ttl_s=ttl)


async def create_content(
    gw: Gateway, slot: Slot, content: dict, chat: ChatPrompt, ttl: float, request: Request, api: str
) -> CachedContent:
    """Store a tenant's new cached content (``chat``: its text rendered as a system message) and pin its tokens
    (both APIs' create): the tenant's limits are checked before any compute is spent, and an object whose pin fails
    is deleted again."""
    t = slot.tenant
    tokens = chat.token_ids
    await gw.admission.admit(slot, tokens, 1, api, chat, len(tokens), ttl)  # its budget: all written
    limit = t.config.cache.max_pinned_tokens
    if limit is not None and len(tokens) > limit:
        raise err(400, f"the content has {len(tokens)} tokens; this tenant may pin {limit}", api)
    store = gw.contents[t.name]
    try:
        cc = await store.create(t.name, content, tokens, ttl)
    except LimitExceeded as exc:
        raise err(429, str(exc), api, LIMIT_RETRY_AFTER_S) from None
    try:
        await pin_content(gw, slot, tokens, ttl, request, api)  # computed and pinned now, so the first use is a read
    except BaseException:
        gw.accounting.spawn(store.delete(t.name, cc.id))
        raise
    return cc


async def renew_content(gw: Gateway, slot: Slot, cid: str, ttl: float, request: Request, api: str) -> CachedContent:
    """Give a cached content a new lifetime (both APIs' update): its tokens are pinned for it first (a re-pin
    costs what computing the content costs), then the object's TTL is set; 404 if it does not exist."""
    t = slot.tenant
    store = gw.contents[t.name]
    cc = await store.get(t.name, f"cachedContents/{cid}")
    if cc is None:
        raise err(404, f"cached content {cid!r} not found", api)
    await gw.admission.admit(slot, cc.token_ids, 1, api, None, len(cc.token_ids), ttl)
    await pin_content(gw, slot, cc.token_ids, ttl, request, api)  # pinned for the new lifetime before it is promised
    renewed = await store.set_ttl(t.name, f"cachedContents/{cid}", ttl)
    if renewed is None:  # deleted meanwhile
        raise err(404, f"cached content {cid!r} not found", api)
    return renewed


class CachedContentsApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def _ttl(self, t: Tenant, ttl: str | None) -> float:
        return self.gw.admission.ttl(ttl, t.config.cache.default_ttl, MAX_CACHED_CONTENT_TTL_S, "ttl", API)

    @routes.post("/{tenant}/v1/cachedContents")
    async def create_cached_content(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._create(slot, request))

    async def _create(self, slot: Slot, request: Request):
        gw, t = self.gw, slot.tenant
        body: CachedContentRequest = await gw.admission.body(request, CachedContentRequest, API)
        if body.model is not None:
            gw.admission.check_model(body.model.removeprefix("models/"), API)
        text = body.text
        if not text:
            raise err(400, "contents: a cached content needs some text", API)
        ttl = self._ttl(t, body.ttl)
        chat = await gw.prompts.chat(t, [{"role": "system", "content": text}], API, generation=False)
        return (await create_content(gw, slot, {"text": text}, chat, ttl, request, API)).public()

    @routes.get("/{tenant}/v1/cachedContents")
    async def list_cached_contents(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return CachedContentList(cachedContents=[c.public() for c in await self.gw.contents[t.name].list(t.name)])

    @routes.get("/{tenant}/v1/cachedContents/{cid}")
    async def get_cached_content(self, tenant: str, cid: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        cc = await self.gw.contents[t.name].get(t.name, f"cachedContents/{cid}")
        if cc is None:
            raise err(404, f"cached content {cid!r} not found", API)
        return cc.public()

    @routes.patch("/{tenant}/v1/cachedContents/{cid}")
    async def patch_cached_content(self, tenant: str, cid: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._patch(slot, cid, request))

    async def _patch(self, slot: Slot, cid: str, request: Request):
        gw, t = self.gw, slot.tenant
        body: CachedContentPatch = await gw.admission.body(request, CachedContentPatch, API)
        return (await renew_content(gw, slot, cid, self._ttl(t, body.ttl), request, API)).public()

    @routes.delete("/{tenant}/v1/cachedContents/{cid}")
    async def delete_cached_content(self, tenant: str, cid: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        if not await self.gw.contents[t.name].delete(t.name, f"cachedContents/{cid}"):
            raise err(404, f"cached content {cid!r} not found", API)
        return JSONResponse({})
