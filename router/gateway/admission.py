"""Admission of a request to one gateway replica (``Admission``): the tenant authenticated by its key, the body read
and checked, the tenant's in-flight places, request rate and prompt size, the model and the context; an admitted
prompt kept in the tenant's advisor sample. Every check answers in the calling API's error format."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from common.lora import AdapterRef
from common.tenant_config import KeyLimitsConfig
from router.gateway.access import current as current_access
from router.gateway.budgets import BudgetGate
from router.gateway.chat import ChatPrompt
from router.gateway.errors import err
from router.gateway.store import KeyRing, PromptSamples, RateLimiter, presented_key
from router.gateway.tenants import Slot, SlotStream, Tenant, key_scope
from router.gateway.tracing import current_trace, traced
from router.gateway.wire import MAX_BODY_BYTES, BodyError, parse_body, ttl_seconds

T = TypeVar("T")

MAX_KEY_LIMITERS = 10_000


class Admission:
    """``tenants`` by name, their ``keys`` (hashed), the served ``model_id`` and its context (``max_model_len``);
    ``request_rates``: each tenant's request-rate limiter without its token budget (for requests that generate
    nothing); ``samples``: the advisor's prompt samples, written in the background through ``spawn``."""

    def __init__(
        self,
        tenants: dict[str, Tenant],
        keys: KeyRing,
        model_id: str,
        max_model_len: int,
        request_rates: dict[str, RateLimiter],
        samples: PromptSamples,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
    ) -> None:
        self.tenants, self.keys, self.model_id, self.max_model_len = tenants, keys, model_id, max_model_len
        self.request_rates, self.samples, self.spawn = request_rates, samples, spawn
        self.budgets: BudgetGate | None = None  # the tenants' budgets, set by the Gateway
        self._key_limiters: dict[tuple[str, str], RateLimiter] = {}  # (key id, its limits as JSON) -> its limiter
        self.redis: Any = None  # the gateway's Redis client (the keys' limiters), set by the Gateway

    def auth(self, tenant: str, request: Request, api: str) -> Tenant:
        """The tenant, if the request carries one of its keys (``presented_key``). An unknown tenant gets the very
        same 401 as a wrong key, so tenant names cannot be probed. Every route calls this first: the request's
        errors from here on are in ``api``'s format."""
        request.state.api = api
        with traced("auth"):
            t = self.tenants.get(tenant)
            key = presented_key(request.headers)
            # The key's own record (its limits and budget; keys from the config have none), then the key check
            # itself: hashed either way, so an unknown tenant takes the same time.
            request.state.key = record = self.keys.find(tenant, key)
            ok = record is not None or self.keys.authenticate(tenant, key)
            if t is None or not ok:
                raise err(401, "invalid API key for this tenant", api)
        acc = current_access()  # the access log's record of this request (router/gateway/access.py)
        if acc is not None:
            acc.tenant, acc.model = t.name, self.model_id
        rt = current_trace()
        if rt is not None:
            rt.annotate({"kvgrid.tenant": t.name, "kvgrid.api": api, "kvgrid.model": self.model_id})
        return t

    async def body(self, request: Request, model: type[BaseModel], api: str) -> Any:
        try:
            return await parse_body(request, model, MAX_BODY_BYTES)
        except BodyError as exc:
            raise err(exc.status, exc.message, api) from None

    async def held(self, t: Tenant, request: Request, work: Callable[[Slot], Coroutine[Any, Any, T]]) -> T:
        """Run ``work(slot)`` for the ``request`` ``auth`` let in, in one of the tenant's in-flight places in this
        replica (429 when all are taken); a streamed answer (``SlotStream``) keeps the place until its stream ends.
        The work passes ``slot`` on to ``admit`` and to accounting: what the request reserves and costs ends with
        it; the slot also carries the request's key record (its own limits and budget)."""
        api = request.state.api
        limit = t.config.limits.max_inflight_requests
        if t.inflight >= limit:
            raise err(
                429,
                f"this tenant has {limit} requests in flight (limits.max_inflight_requests); retry "
                "when one has finished",
                api,
            )
        slot = Slot(t, getattr(request.state, "key", None))
        streamed = False
        try:
            result = await work(slot)
            if isinstance(result, SlotStream):
                result.slot, streamed = slot, True
            return result
        finally:
            if not streamed:
                slot.release()

    def check_model(self, model: str, api: str) -> None:
        """404 unless ``model`` is the base model (what cached contents are made for)."""
        if model != self.model_id:
            raise err(404, f"model {model!r} does not exist; this gateway serves {self.model_id!r}", api)

    def model_ref(self, t: Tenant, model: str, api: str) -> AdapterRef | None:
        """The LoRA adapter of ``t`` a request's ``model`` names (None: the base model); 404 naming what the
        tenant may use when it is neither."""
        if model == self.model_id:
            return None
        ref = t.adapters.get(model)
        if ref is None:
            have = ", ".join(repr(m) for m in (self.model_id, *sorted(t.adapters)))
            raise err(404, f"model {model!r} does not exist; this tenant may use {have}", api)
        return ref

    def pick_model(self, slot: Slot, model: str, api: str) -> AdapterRef | None:
        """``model_ref``, also kept on ``slot`` (the request's usage is counted per adapter too)."""
        ref = self.model_ref(slot.tenant, model, api)
        slot.adapter = None if ref is None else (model, ref)
        return ref

    def ttl(self, value: str | None, default: float, longest: float, field: str, api: str) -> float:
        """A TTL the request gives in ``field`` (``ttl_seconds``), its error in ``api``'s format."""
        try:
            return ttl_seconds(value, default, longest, field)
        except BodyError as exc:
            raise err(exc.status, exc.message, api) from None

    def check_context(self, prompt: list[int], max_tokens: int, field: str, api: str) -> None:
        """400 naming ``field`` when a ``max_tokens`` the client gave does not fit in the context after the prompt
        (a default one is capped by the engine instead; a prompt that alone fills it is ``admit``'s 413)."""
        n, ctx = len(prompt), self.max_model_len
        if n < ctx < n + max_tokens:
            raise err(
                400,
                f"{field}: this model's maximum context length is {ctx} tokens; however, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). Reduce the "
                f"prompt or {field} (at most {ctx - n} here)",
                api,
            )

    async def admit(
        self,
        slot: Slot,
        prompt: list[int],
        max_tokens: int,
        api: str,
        chat: ChatPrompt | None = None,
        write: int = 0,
        write_ttl_s: float = 0.0,
    ) -> None:
        """Check the prompt's length and the tenant's limits before any work is done for it (``chat``: what the
        prompt was rendered from, for the advisor's sample), and reserve its worst-case cost in its budget
        (``max_tokens`` over all choices; ``write`` tokens it may write to a cache entry living ``write_ttl_s``)
        until ``slot`` is released."""
        t = slot.tenant
        if not prompt:
            raise err(400, "the prompt is empty", api)
        self.check_size(t, len(prompt), max_tokens, api)
        retry_after = await t.limiter.admit(t.name, len(prompt) + max_tokens)
        if retry_after is not None:
            raise err(429, "rate limit reached for this tenant; retry later", api, retry_after)
        key_limiter = self.key_limiter(slot)
        if key_limiter is not None and slot.key is not None:
            kid = slot.key.id
            retry_after = await key_limiter.admit(key_scope(t.name, kid), len(prompt) + max_tokens)
            if retry_after is not None:
                raise err(429, f"rate limit reached for this API key ({kid}); retry later", api, retry_after)
        if self.budgets is not None:
            await self.budgets.admit(slot, len(prompt), max_tokens, api, write, write_ttl_s)
        self.sample(t, prompt, chat)

    def key_limiter(self, slot: Slot) -> RateLimiter | None:
        """The rate limiter of the request's API key, when it has limits of its own."""
        rec = slot.key
        if rec is None or not rec.limits or self.redis is None:
            return None
        lim = KeyLimitsConfig.model_validate(rec.limits)
        cache_key = (rec.id, lim.model_dump_json())
        limiter = self._key_limiters.get(cache_key)
        if limiter is None:
            if len(self._key_limiters) > MAX_KEY_LIMITERS:  # keys come and go: start over rather than grow
                self._key_limiters.clear()
            limiter = self._key_limiters[cache_key] = RateLimiter(self.redis, lim.requests_per_s, lim.tokens_per_min)
        return limiter

    def check_size(self, t: Tenant, n: int, max_tokens: int, api: str) -> None:
        """413 for a prompt of ``n`` tokens that the context, or the tenant's limits, do not take."""
        if n >= self.max_model_len:
            raise err(413, f"the prompt has {n} tokens; the context is {self.max_model_len}", api)
        lim = t.config.limits
        if lim.max_prompt_tokens is not None and n > lim.max_prompt_tokens:
            raise err(413, f"the prompt has {n} tokens; this tenant may send {lim.max_prompt_tokens}", api)
        if lim.tokens_per_min is not None and n + max_tokens > lim.tokens_per_min:
            raise err(
                413,
                f"the prompt and max tokens ({n + max_tokens}) exceed this tenant's {lim.tokens_per_min} tokens "
                "per minute",
                api,
            )

    async def admit_request(self, t: Tenant, api: str) -> None:
        """Count a request that generates nothing (count_tokens) against the tenant's request rate: 429 past it."""
        retry_after = await self.request_rates[t.name].admit(t.name, 0)
        if retry_after is not None:
            raise err(429, "rate limit reached for this tenant; retry later", api, retry_after)

    def sample(self, t: Tenant, prompt: list[int], chat: ChatPrompt | None = None) -> None:
        """Keep an admitted prompt in the tenant's advisor sample (``advice: {sample: N}``; off by default): the
        messages ``chat`` was rendered from when the prompt ends with it, else its token ids. Best effort, in the
        background."""
        keep = t.config.advice.sample
        if not keep:
            return
        row: dict[str, Any] = {"t": time.time()}
        ids = chat.token_ids if chat is not None else []
        if (
            chat is not None
            and chat.source is not None
            and len(ids) <= len(prompt)
            and prompt[len(prompt) - len(ids) :] == ids
        ):
            row.update(messages=chat.source.messages, gen=chat.source.generation, prefix=len(prompt) - len(ids))
            if chat.source.tools:
                row["tools"] = chat.source.tools
        else:
            row["token_ids"] = prompt
        self.spawn(self.samples.add(t.name, row, keep, t.config.advice.ttl))
