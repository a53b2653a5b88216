"""The HTTP gateway: every tenant's OpenAI- and Anthropic-compatible APIs, cached content objects and Prometheus
metrics, under ``/{tenant}/...``. It authenticates (in memory), tokenises, applies the tenant's limits and cache
policy, asks a router replica for a worker group, streams the group's outputs back, and records usage.
``create_app`` makes its ASGI app; router/gateway/server.py serves it from every gateway replica.

One app serves every tenant, so no route lists them, and an unknown tenant gets exactly the 401 of a wrong
key."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.


import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel
from ray.exceptions import RayActorError, RayError

from common.config import ServeConfig, TenantConfig, parse_duration
from common.model_config import ModelConfig, load_tokenizer
from common.outputs import RequestOutput
from common.protocol import GroupLink, GroupUnhealthyError, RequestAborted, RequestFailed, Submit
from common.sampling import SamplingParams
from router.gateway.protocol import (
    MAX_BODY_BYTES,
    BodyError,
    CachedContentPatch,
    CachedContentRequest,
    ChatRequest,
    CompletionRequest,
    MessagesRequest,
    parse_body,
)
from router.gateway.chat import ChatPrompt, ChatTemplateError, encode_chat
from router.gateway.routes import Routes
from router.routing.router import NoGroup, Overloaded
from router.gateway.store import (
    CachedContentStore,
    EntryStore,
    KeyRing,
    LimitExceeded,
    RateLimiter,
    StoreUnavailable,
    UsageLedger,
    connect,
    presented_key,
)

log = logging.getLogger(__name__)

MAX_BREAKPOINTS = 4
MAX_PIN_TTL_S = 3600.0  # cache_control TTLs: Anthropic's longest
MAX_CACHED_CONTENT_TTL_S = 7 * 24 * 3600.0
MAX_GROUP_RETRIES = 2  # other groups tried after a group fails under a request
# A router replica that takes longer is skipped (it routes in about a millisecond; a killed one that Ray is
# restarting holds calls until it is back, seconds later)...
ROUTE_TIMEOUT_S = 0.5
LAST_ROUTE_TIMEOUT_S = 30.0  # ...unless it is the last one left to try
HEDGE_DELAY_S = 0.05  # a replica routes in about a millisecond: one silent for longer is not waited on alone
# Hedges per routed request over time (and the most saved up): when every replica is slow, hedging every request
# would double the routing load on replicas already behind; past the budget a request waits for its timeout.
HEDGE_BUDGET = 0.1
HEDGE_BURST = 10.0
ROUTER_COOLDOWN_S = 10.0  # a replica that failed is tried last for this long (Ray restarts it meanwhile)
GROUP_SILENCE_S = 60.0  # a request without output for this long makes the gateway ask its group's health
HEALTH_TIMEOUT_S = 10.0
ROUTER_RETRY_AFTER_S = 2.0  # no router replica answered: a restarted one resyncs within a few seconds
STORE_RETRY_AFTER_S = 2.0

routes = Routes()  # the gateway's endpoints, bound to one Gateway by create_app


class _GroupFailed(Exception):
    """The worker group running a request failed (died, lost a rank, or went silent)."""


class ApiError(Exception):
    """An error answered in the calling API's own format."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", api: str = "openai",
                 retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.api = status, message, kind, api
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        if self.api == "anthropic":
            body: dict[str, Any] = {"type": "error", "error": {"type": self.kind, "message": self.message}}
        else:
            body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))} if self.status in (429, 503) else None
        return JSONResponse(body, status_code=self.status, headers=headers)


_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _err(status: int, message: str, api: str, retry_after: float = 1.0) -> ApiError:
    kind = _KINDS.get(status, "api_error")
    if api == "openai" and status == 401:
        kind = "invalid_request_error"
    return ApiError(status, message, kind, api, retry_after)


def _api_of(path: str) -> str:
    return "anthropic" if path.endswith("/messages") else "openai"


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
    """Redis is down or slow: what needs it answers a retryable 503 at once instead of waiting."""
    return _err(503, "the service's state store is unavailable; retry shortly", _api_of(request.url.path),
                STORE_RETRY_AFTER_S).response()


class _Metrics:
    def __init__(self, tenant: str) -> None:
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["tenant"]
        self.requests = Counter("kvgrid_requests", "Requests served", lbl, registry=r)
        self.prompt = Counter("kvgrid_prompt_tokens", "Prompt tokens", lbl, registry=r)
        self.cached = Counter("kvgrid_cached_tokens", "Prompt tokens served from the prefix cache", lbl, registry=r)
        self.output = Counter("kvgrid_output_tokens", "Output tokens", lbl, registry=r)
        self.hit_rate = Gauge("kvgrid_prefix_hit_rate", "Cached / prompt tokens so far", lbl, registry=r)
        self.predicted = Counter("kvgrid_router_predicted_cached_tokens", "Cached tokens the router expected", lbl,
                                 registry=r)
        self.actual = Counter("kvgrid_router_actual_cached_tokens", "Cached tokens the group reported", lbl,
                              registry=r)
        self.tenant = tenant
        self._prompt_total = self._cached_total = 0

    def record(self, prompt: int, cached: int, output: int, predicted: int, actual: int) -> None:
        """``cached``: the reuse reported to the client (the tenant's policy); ``actual``: what the group reused,
        against which the router's ``predicted`` is judged."""
        t = self.tenant
        self.requests.labels(t).inc()
        self.prompt.labels(t).inc(prompt)
        self.cached.labels(t).inc(cached)
        self.output.labels(t).inc(output)
        self.predicted.labels(t).inc(predicted)
        self.actual.labels(t).inc(actual)
        self._prompt_total += prompt
        self._cached_total += cached
        self.hit_rate.labels(t).set(self._cached_total / max(1, self._prompt_total))


class _Tenant:
    """One tenant's state in this replica: its config, rate limiter, metrics and in-flight count."""

    def __init__(self, config: TenantConfig, limiter: RateLimiter) -> None:
        self.name, self.config = config.name, config
        self.limiter = limiter
        self.metrics = _Metrics(config.name)
        self.inflight = 0


class _Slot:
    """One of a tenant's in-flight places in this replica; released exactly once."""

    def __init__(self, tenant: _Tenant) -> None:
        self.tenant, self.held = tenant, True
        tenant.inflight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.tenant.inflight -= 1


class _SlotStream(StreamingResponse):
    """A streamed answer that holds its request's in-flight slot until the stream ends, however it ends."""

    slot: _Slot | None = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.slot is not None:
                self.slot.release()


def _failure(exc: Exception, group: str, api: str) -> Exception:
    """What a failed output of a group means: a bad request (400), an abort (503), the group itself failing (a
    retry elsewhere), or an error of this one request (500; the group keeps serving everyone else)."""
    if isinstance(exc, ValueError):
        return _err(400, str(exc), api)
    if isinstance(exc, RequestAborted):
        return _err(503, "the request was aborted on its worker group; retry it", api)
    if isinstance(exc, RequestFailed):  # the engine failed this request alone; its group keeps serving
        return ApiError(500, f"the request failed on worker group {group} ({exc}); the service keeps serving, "
                        "retry it or change its parameters", "api_error", api)
    if isinstance(exc, GroupUnhealthyError):
        return _GroupFailed(f"{type(exc).__name__}: {exc}")
    return ApiError(500, f"internal error in worker group {group} ({type(exc).__name__})", "api_error", api)


def _no_account(out: RequestOutput, predicted: int) -> None:
    """Internal requests (computing cached content) are recorded by their callers."""


async def _primed(run):
    """Start ``run`` now (so its first error surfaces before a response is sent) and return an equivalent."""
    first = await run.__anext__()

    async def rest():
        try:
            yield first
            async for item in run:
                yield item
        finally:  # a stream cut short stops ``run`` now, not when the collector gets to it
            await run.aclose()

    return rest()


async def _last(run) -> tuple[RequestOutput, int]:
    out = None
    async for out in run:
        pass
    assert out is not None
    return out


async def _client_gone(request: Request) -> None:
    """Returns when the client has disconnected (the body was read already: the next message is the
    disconnect). Ray Serve forwards it even when the request asked Serve not to cancel on disconnect."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the connection state cannot be read: never cut a request on that
        await asyncio.Event().wait()


async def _watched(request: Request, run: AsyncIterator, api: str) -> AsyncIterator:
    """``run``'s items until the client disconnects; then ``run`` is stopped (its group request aborted) and a
    499 raised, whatever headers the client sent."""
    gone = asyncio.ensure_future(_client_gone(request))
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(run.__anext__())
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise _err(499, "the client closed the request", api)
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        gone.cancel()
        if step is not None and not step.done():
            step.cancel()  # runs ``run``'s own cleanup (abort on the group, usage) inside the step
            await asyncio.wait({step})
        await run.aclose()


class _HedgeBudget:
    """A token bucket of hedges: every request routed earns ``rate`` of one (up to ``burst``), a hedge spends
    one. A replica slow now and then is hedged every time; all of them slow at once, only a few requests are."""

    def __init__(self, rate: float = HEDGE_BUDGET, burst: float = HEDGE_BURST) -> None:
        self.rate, self.burst, self.tokens = rate, burst, burst

    def earn(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.rate)

    def spend(self) -> bool:
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


async def _bounded(awaitable, timeout_s: float):
    return await asyncio.wait_for(awaitable, timeout_s)


async def _outputs(link: GroupLink, req: Submit, decision, api: str) -> AsyncIterator[RequestOutput]:
    """A group's outputs for one request, its errors as the gateway answers them. A request may wait in a busy
    group's queue for long, so silence alone is no failure: every ``GROUP_SILENCE_S`` without output the leader
    is asked whether the group is healthy (a hung step fails it after ``step_timeout_s``); a group that is
    unhealthy or does not answer has failed."""

    async def silent() -> None:
        try:
            reason = await _bounded(decision.leader.health.remote(), HEALTH_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as exc:
            reason = f"no output for {GROUP_SILENCE_S:.0f} s and no health answer ({type(exc).__name__})"
        if reason is not None:
            raise _GroupFailed(reason)

    stream = link.stream(req, silent, GROUP_SILENCE_S)
    try:
        async for out in stream:
            yield out
    except _GroupFailed:
        raise
    except Exception as exc:
        raise _failure(exc, decision.group, api) from None
    finally:  # a consumer that stops early aborts the request now, not when the stream is collected
        await stream.aclose()


def _stop_reason(out: RequestOutput) -> str:
    if out.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if isinstance(out.stop_reason, str) else "end_turn"


class Gateway:
    """Every tenant's APIs in one deployment; ``config`` carries no API keys (``keys`` holds their hashes)."""

    def __init__(self, config: ServeConfig, keys: KeyRing, model_path: str, routers: list, redis_url: str) -> None:
        self.config = config
        self.model_id = config.model_id
        self.keys = keys
        self.tokenizer = load_tokenizer(model_path)
        mcfg = ModelConfig.from_folder(model_path)  # the same limit the engine enforces
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self.routers = list(routers)  # the RouterService replicas; each request stays with the one that routed it
        self._next_router = secrets.randbelow(len(self.routers))
        self._router_failed_at = [-math.inf] * len(self.routers)
        self._hedges = _HedgeBudget()
        self.redis = connect(redis_url, config.redis_timeout_s)
        self.ledger = UsageLedger(self.redis)
        self.entries = EntryStore(self.redis)
        self.contents = {t.name: CachedContentStore(self.redis, t.limits.max_cached_contents,
                                                    t.limits.max_cached_content_tokens) for t in config.tenants}
        self.tenants = {t.name: _Tenant(t, RateLimiter(self.redis, t.limits.requests_per_s, t.limits.tokens_per_min))
                        for t in config.tenants}
        self._background: set[asyncio.Task] = set()
        self._links: dict[str, GroupLink] = {}  # group -> this replica's subscription to its leader

    async def close(self) -> None:
        """When the replica stops, on the loop that served it: write the usage still buffered (Redis permitting)."""
        try:
            await self.ledger.close()
        except StoreUnavailable:
            log.warning("usage not yet written to Redis was lost at shutdown")

    # -- plumbing ----------------------------------------------------------------------------------------------

    async def _body(self, request: Request, model: type[BaseModel], api: str) -> Any:
        try:
            return await parse_body(request, model, MAX_BODY_BYTES)
        except BodyError as exc:
            raise _err(exc.status, exc.message, api) from None

    def _auth(self, tenant: str, request: Request, api: str) -> _Tenant:
        """The tenant, if the request carries one of its keys. An unknown tenant gets the very same 401 as a
        wrong key, so tenant names cannot be probed."""
        t = self.tenants.get(tenant)
        ok = self.keys.authenticate(tenant, presented_key(request.headers))  # hashed either way: no timing difference
        if t is None or not ok:
            raise _err(401, "invalid API key for this tenant", api)
        return t

    async def _held(self, t: _Tenant, api: str, work):
        """Run the coroutine ``work`` in one of the tenant's in-flight places in this replica (429 when all are
        taken); a streamed answer keeps the place until its stream ends."""
        limit = t.config.limits.max_inflight_requests
        if t.inflight >= limit:
            work.close()
            raise _err(429, f"this tenant has {limit} requests in flight (limits.max_inflight_requests); retry "
                       "when one has finished", api)
        slot = _Slot(t)
        try:
            result = await work
            if isinstance(result, _SlotStream):
                result.slot, slot = slot, None
            return result
        finally:
            if slot is not None:
                slot.release()

    def _spawn(self, coro) -> None:
        """Run a best-effort Redis write in the background (its failure is logged, never the request's)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("gateway background write failed: %s", task.exception())

    def _check_model(self, model: str, api: str) -> None:
        if model != self.model_id:
            raise _err(404, f"model {model!r} does not exist; this gateway serves {self.model_id!r}", api)

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _chat(self, messages: list[dict[str, str]], api: str, generation: bool = True) -> ChatPrompt:
        """The chat template applied to ``messages``; their texts never become special tokens (router/gateway/chat.py)."""
        try:
            return encode_chat(self.tokenizer, messages, add_generation_prompt=generation)
        except ChatTemplateError as exc:
            raise _err(400, f"messages: {exc}", api) from None

    async def _cached_prefix(self, t: _Tenant, cid: str | None, api: str) -> tuple[list[int], float]:
        """Token ids and remaining TTL of a referenced cached content object."""
        if cid is None:
            return [], 0.0
        name = cid if cid.startswith("cachedContents/") else f"cachedContents/{cid}"
        cc = await self.contents[t.name].get(t.name, name)
        if cc is None:
            raise _err(404, f"cached content {cid!r} not found", api)
        return cc.token_ids, max(1.0, cc.expires - time.time())

    def _params(self, max_tokens: int, temperature: float, top_p: float, stop, seed, api: str, top_k: int = 0,
                ignore_eos: bool = False):
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                stop=stop or [], seed=seed, ignore_eos=ignore_eos,
            )
        except ValueError as exc:
            raise _err(400, str(exc), api) from None

    async def _admit(self, t: _Tenant, prompt: list[int], max_tokens: int, api: str) -> None:
        """Check the prompt's length and the tenant's limits before any work is done for it."""
        if not prompt:
            raise _err(400, "the prompt is empty", api)
        if len(prompt) >= self.max_model_len:
            raise _err(413, f"the prompt has {len(prompt)} tokens; the context is {self.max_model_len}", api)
        lim = t.config.limits
        if lim.max_prompt_tokens is not None and len(prompt) > lim.max_prompt_tokens:
            raise _err(413, f"the prompt has {len(prompt)} tokens; this tenant may send {lim.max_prompt_tokens}",
                       api)
        if lim.tokens_per_min is not None and len(prompt) + max_tokens > lim.tokens_per_min:
            raise _err(413, f"the prompt and max tokens ({len(prompt) + max_tokens}) exceed this tenant's "
                       f"{lim.tokens_per_min} tokens per minute", api)
        retry_after = await t.limiter.admit(t.name, len(prompt) + max_tokens)
        if retry_after is not None:
            raise _err(429, "rate limit reached for this tenant; retry later", api, retry_after)

    def _reported_cached(self, t: _Tenant, num_cached: int) -> int:
        """Implicit tenants see reuse from ``min_prefix_tokens`` up; explicit tenants see all of it."""
        c = t.config.cache
        return num_cached if c.mode == "explicit" or num_cached >= c.min_prefix_tokens else 0

    async def _route(self, t: _Tenant, prompt: list[int], attempt: str, failed: list[str], api: str):
        """(router replica, decision) from the first replica that routes the request. Hedged: a replica that has
        not answered within ``HEDGE_DELAY_S`` is not waited on alone, the next one is asked too (once per
        request, within ``HEDGE_BUDGET``), and the first decision wins; every other replica asked cancels the
        route (it may have made it too: its load, predictions and recent prefill are undone), so no replica
        counts the request but the one that serves it. A dead, restarting or stuck replica is skipped, and so is
        one that knows no group yet (just restarted: the supervisor hands it the groups within a second). 503
        when none routes it (a retry a moment later works)."""
        n = len(self.routers)
        self._next_router = (self._next_router + 1) % n
        self._hedges.earn()
        now = time.monotonic()
        order = sorted(((self._next_router + i) % n for i in range(n)),  # round robin, recent failures last
                       key=lambda j: now - self._router_failed_at[j] < ROUTER_COOLDOWN_S)
        pending: dict[asyncio.Future, int] = {}  # call -> position in ``order``
        asked = 0  # replicas asked so far: order[:asked]
        hedged = False
        no_group: str | None = None
        won: int | None = None

        def ask() -> None:
            nonlocal asked
            timeout_s = ROUTE_TIMEOUT_S if asked < n - 1 else LAST_ROUTE_TIMEOUT_S
            call = self.routers[order[asked]].route.remote(t.name, prompt, attempt, failed)
            pending[asyncio.ensure_future(_bounded(call, timeout_s))] = asked
            asked += 1

        ask()
        try:
            while pending:
                hedge = HEDGE_DELAY_S if asked < n and not hedged else None
                done, _ = await asyncio.wait(pending, timeout=hedge, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    hedged = True  # the replicas asked so far are slow: ask the next one too, budget permitting
                    if self._hedges.spend():  # (else their timeouts hand over)
                        ask()
                    continue
                decided = [call for call in done if call.exception() is None]
                if decided:  # a decision wins over whatever else came back with it (a 429 too)
                    winner = min(decided, key=pending.__getitem__)  # of those, the replica asked first
                    won = pending[winner]
                    for call in done:
                        k = pending.pop(call)
                        if call is not winner:  # it answered: not slow, but it may have routed the request too
                            self.routers[order[k]].cancel_route.remote(attempt)
                    return self.routers[order[won]], winner.result()
                for call in done:
                    j = order[pending.pop(call)]
                    try:
                        call.result()
                    except (RayActorError, asyncio.TimeoutError):
                        self._router_failed_at[j] = time.monotonic()
                        self.routers[j].cancel_route.remote(attempt)  # in case it did route it
                    except RayError as exc:
                        cause = getattr(exc, "cause", None)
                        if isinstance(cause, Overloaded):
                            raise _err(429, f"overloaded: {cause}; retry shortly", api) from None
                        no_group = str(cause) if isinstance(cause, NoGroup) else type(exc).__name__
                if asked < n:
                    ask()  # what came back were failures: the next replica, without waiting
        finally:
            # The others asked (all of them when the client left or no decision came): they may have routed the
            # request, so they cancel it. One asked before the winner and still silent is slow or dead (a killed
            # replica holds calls until Ray has restarted it): it is tried last for a while.
            for call, k in pending.items():
                call.cancel()
                call.add_done_callback(lambda c: c.cancelled() or c.exception())  # its late failure is expected
                self.routers[order[k]].cancel_route.remote(attempt)
                if won is not None and k < won:
                    self._router_failed_at[order[k]] = time.monotonic()
        if no_group is not None:
            raise _err(503, f"no worker group available ({no_group}); retry shortly", api)
        raise _err(503, "no router replica is available; retry shortly", api, ROUTER_RETRY_AFTER_S)

    async def _generate(
        self, t: _Tenant, prompt: list[int], params: SamplingParams, api: str, pin_tokens: int, pin_ttl_s: float,
        account, restartable: bool = False,
    ) -> AsyncIterator[tuple[RequestOutput, int]]:
        """Route and run one request; yields (output, tokens the router expected cached). However it ends
        (finished, failed, or the client went away), ``account(last output, predicted)`` records its usage
        once, and an unfinished request is aborted on its group (by its ``GroupLink`` stream).

        A group that fails (or is silent and unhealthy, see ``_outputs``) is reported to the routers (which route
        nothing more to it) and the request is retried on another group, as long as nothing has been yielded
        yet, or at any point when ``restartable`` (the caller keeps only the last output). A request the
        engine failed alone answers 500; its group keeps serving."""
        failed: list[str] = []
        rid = f"{t.name}-{secrets.token_hex(8)}"  # unique across router replicas and gateways
        while True:
            attempt = f"{rid}-{len(failed)}"
            router = decision = out = None
            yielded = finished = False
            try:
                router, decision = await self._route(t, prompt, attempt, failed, api)
                req = Submit(prompt, params, t.name, attempt, pin_tokens, pin_ttl_s)
                async for out in _outputs(self._link(decision), req, decision, api):
                    if not finished and len(out.token_ids) == len(out.new_token_ids):
                        router.on_prefill_done.remote(attempt)
                    finished = out.finished
                    yielded = True
                    yield out, decision.cached_tokens
                    if finished:
                        break
                return
            except _GroupFailed as exc:
                for r in self.routers:  # no replica should send more requests there
                    r.report_failure.remote(decision.group, str(exc))
                failed.append(decision.group)
                if (yielded and not restartable) or len(failed) > MAX_GROUP_RETRIES:
                    raise _err(503, f"worker group {decision.group} failed during the request; retry it",
                               api) from None
                out = None  # nothing of the failed attempt is billed: the retry starts over
            finally:
                if router is not None:
                    router.on_finish.remote(attempt)  # also when the client left during routing
                if out is not None:
                    account(out, decision.cached_tokens)

    def _link(self, decision) -> GroupLink:
        """This replica's one subscription to the decision's group (a new one for a restarted group's new leader,
        or after the old one failed): the deltas of all its requests there arrive together, once per step."""
        link = self._links.get(decision.group)
        if link is None or link.closed or link.leader != decision.leader:
            link = self._links[decision.group] = GroupLink(decision.group, decision.leader)
        return link

    def _account(self, t: _Tenant, out: RequestOutput, predicted: int, cached: int, write: int = 0,
                 read: int = 0) -> None:
        n_prompt = len(out.prompt_token_ids)
        self.ledger.record(
            t.name, requests=1, prompt_tokens=n_prompt, cached_tokens=cached,
            output_tokens=len(out.token_ids), cache_write_tokens=write, cache_read_tokens=read,
        )
        t.metrics.record(n_prompt, cached, len(out.token_ids), predicted, out.num_cached_tokens)

    # -- documentation (``http.docs``) ------------------------------------------------------------------------

    @routes.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        if not self.config.http.docs:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse(request.app.openapi())

    @routes.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        if not self.config.http.docs:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvgrid gateway")

    # -- OpenAI ------------------------------------------------------------------------------------------------

    @routes.get("/{tenant}/v1/models")
    async def models(self, tenant: str, request: Request):
        self._auth(tenant, request, "openai")
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                            "owned_by": "kvgrid"}]}

    @routes.post("/{tenant}/v1/chat/completions")
    async def chat_completions(self, tenant: str, request: Request):
        t = self._auth(tenant, request, "openai")
        return await self._held(t, "openai", self._chat_completions(t, request))

    async def _chat_completions(self, t: _Tenant, request: Request):
        body: ChatRequest = await self._body(request, ChatRequest, "openai")
        self._check_model(body.model, "openai")
        if body.n != 1:
            raise _err(400, "n must be 1", "openai")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text}
                    for m in body.messages]
        prefix, ttl = await self._cached_prefix(t, body.cached_content, "openai")
        prompt = prefix + self._chat(messages, "openai").token_ids
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        return await self._openai_respond(t, request, body, prompt, len(prefix), ttl, max_tokens, chat=True)

    @routes.post("/{tenant}/v1/completions")
    async def completions(self, tenant: str, request: Request):
        t = self._auth(tenant, request, "openai")
        return await self._held(t, "openai", self._completions(t, request))

    async def _completions(self, t: _Tenant, request: Request):
        body: CompletionRequest = await self._body(request, CompletionRequest, "openai")
        self._check_model(body.model, "openai")
        if body.n != 1:
            raise _err(400, "n must be 1", "openai")
        prefix, ttl = await self._cached_prefix(t, body.cached_content, "openai")
        tokens = self._encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if any(not 0 <= tok < len(self.tokenizer) for tok in tokens):
            raise _err(400, "prompt: token id outside the vocabulary", "openai")
        return await self._openai_respond(t, request, body, prefix + tokens, len(prefix), ttl, body.max_tokens,
                                          chat=False)

    async def _openai_respond(self, t: _Tenant, request: Request, body, prompt: list[int], pin: int, ttl: float,
                              max_tokens: int, chat: bool):
        """Run a chat or text completion and answer it, streamed or whole."""
        await self._admit(t, prompt, max_tokens, "openai")
        params = self._params(max_tokens, body.temperature, body.top_p, body.stop, body.seed, "openai",
                              ignore_eos=body.ignore_eos)

        def account(out: RequestOutput, predicted: int) -> None:
            self._account(t, out, predicted, self._reported_cached(t, out.num_cached_tokens))

        run = self._generate(t, prompt, params, "openai", pin, ttl or 300.0, account, not body.stream)
        run = _watched(request, run, "openai")
        rid, created = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), int(time.time())
        if body.stream:
            usage_wanted = body.stream_options is not None and body.stream_options.include_usage
            run = await _primed(run)  # errors before the first token still get their HTTP status
            obj = "chat.completion.chunk" if chat else "text_completion"
            return _SlotStream(
                self._openai_stream(t, run, rid, created, obj, usage_wanted, chat), media_type="text/event-stream"
            )
        out, _ = await _last(run)
        cached = self._reported_cached(t, out.num_cached_tokens)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": out.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.model_id, "choices": [choice], "usage": self._openai_usage(out, cached),
        }

    def _openai_usage(self, out: RequestOutput, cached: int) -> dict[str, Any]:
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _openai_stream(self, t: _Tenant, run, rid: str, created: int, obj: str, usage_wanted: bool,
                             chat: bool):
        def chunk(choice: dict | None, usage: dict | None = None) -> str:
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_id,
                       "choices": [choice] if choice else []}
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            out = None
            async for out, _ in run:
                if out.delta_text or out.finished:
                    delta = {"content": out.delta_text} if chat else None
                    choice = ({"index": 0, "delta": delta, "finish_reason": out.finish_reason} if chat else
                              {"index": 0, "text": out.delta_text, "finish_reason": out.finish_reason})
                    yield chunk(choice)
            if out is not None and usage_wanted:
                yield chunk(None, self._openai_usage(out, self._reported_cached(t, out.num_cached_tokens)))
        except ApiError as exc:
            yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind}})}\n\n"
        yield "data: [DONE]\n\n"

    # -- Anthropic ---------------------------------------------------------------------------------------------

    @routes.post("/{tenant}/v1/messages")
    async def messages(self, tenant: str, request: Request):
        t = self._auth(tenant, request, "anthropic")
        return await self._held(t, "anthropic", self._messages(t, request))

    async def _messages(self, t: _Tenant, request: Request):
        body: MessagesRequest = await self._body(request, MessagesRequest, "anthropic")
        self._check_model(body.model, "anthropic")
        prefix, cc_ttl = await self._cached_prefix(t, body.cached_content, "anthropic")
        chat, marks = self._anthropic_prompt(t, body)
        offsets = chat.offsets
        prompt = prefix + chat.token_ids
        await self._admit(t, prompt, body.max_tokens, "anthropic")
        # Breakpoint = the tokens ending at or before the marked block's end; only whole blocks are pinned.
        bs = self.config.block_size
        ttl_at: dict[int, float] = {}
        for char_end, ttl in marks:
            pos = (len(prefix) + sum(1 for _, end in offsets if end <= char_end)) // bs * bs
            if pos > 0:
                ttl_at[pos] = max(ttl, ttl_at.get(pos, 0.0))
        pin_tokens = max(ttl_at, default=len(prefix))
        pin_ttl = max(ttl_at.values(), default=cc_ttl or t.config.cache.default_ttl)
        entries = {pos: self.entries.entry_key(t.name, prompt[:pos]) for pos in ttl_at}
        # What the entries claim is read: the longest marked prefix whose entry lives (cached content is pinned
        # already). The usage caps it by what the group actually reused; the rest of the marked prefix is a write.
        claim_read = len(prefix) // bs * bs
        alive = await asyncio.gather(*(self.entries.ttl_left(t.name, key) for key in entries.values()))
        for pos, left in sorted(zip(entries, alive), reverse=True):
            if pos > claim_read and left is not None:
                claim_read = pos
                break
        claim_write = max(0, pin_tokens - claim_read) if entries else 0
        params = self._params(body.max_tokens, body.temperature, body.top_p, body.stop_sequences, None,
                              "anthropic", body.top_k)

        def account(out: RequestOutput, predicted: int) -> None:
            usage = self._anthropic_usage(t, out, claim_write, claim_read)
            r, w = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
            self._account(t, out, predicted, r, w, r)
            if out.finished and out.finish_reason != "abort":  # the entries exist once the pin does
                for pos, key in entries.items():
                    self._spawn(self.entries.keep(t.name, key, ttl_at[pos]))

        run = self._generate(t, prompt, params, "anthropic", pin_tokens, pin_ttl, account, not body.stream)
        run = _watched(request, run, "anthropic")
        mid = "msg_" + secrets.token_hex(12)
        if body.stream:
            run = await _primed(run)
            return _SlotStream(self._anthropic_stream(t, run, mid, claim_write, claim_read),
                               media_type="text/event-stream")
        out, _ = await _last(run)
        return {
            "id": mid, "type": "message", "role": "assistant", "model": self.model_id,
            "content": [{"type": "text", "text": out.text}], "stop_reason": _stop_reason(out),
            "stop_sequence": out.stop_reason if isinstance(out.stop_reason, str) else None,
            "usage": self._anthropic_usage(t, out, claim_write, claim_read),
        }

    def _anthropic_prompt(self, t: _Tenant, body: MessagesRequest) -> tuple[ChatPrompt, list[tuple[int, float]]]:
        """The chat prompt, and (character end in its text, TTL) of each ``cache_control`` breakpoint."""
        marked: list[tuple[int, str, float]] = []  # (message index, text, ttl)

        def ttl(cc) -> float:
            try:
                seconds = parse_duration(cc.ttl) if cc.ttl else t.config.cache.default_ttl
            except ValueError as exc:
                raise _err(400, f"cache_control.ttl: {exc}", "anthropic") from None
            if not 1.0 <= seconds <= MAX_PIN_TTL_S:
                raise _err(400, f"cache_control.ttl must be between 1s and {MAX_PIN_TTL_S:.0f}s", "anthropic")
            return seconds

        system_parts: list[str] = []
        for tool in body.tools or []:
            spec = json.dumps({"name": tool.name, "description": tool.description, "input_schema": tool.input_schema})
            system_parts.append(spec)
            if tool.cache_control:
                marked.append((0, spec, ttl(tool.cache_control)))
        for b in body.system or []:
            system_parts.append(b.text or "")
            if b.cache_control:
                marked.append((0, b.text or "", ttl(b.cache_control)))
        messages = [{"role": "system", "content": "\n".join(system_parts)}] if system_parts else []
        for m in body.messages:
            parts = m.content
            idx = len(messages)
            messages.append({"role": m.role, "content": "".join(b.text or "" for b in parts)})
            marked.extend((idx, b.text or "", ttl(b.cache_control)) for b in parts if b.cache_control)
        if len(marked) > MAX_BREAKPOINTS:
            raise _err(400, f"at most {MAX_BREAKPOINTS} cache_control breakpoints are allowed", "anthropic")
        chat = self._chat(messages, "anthropic")
        text = chat.text
        marks, pos = [], 0
        for idx, piece, seconds in marked:
            # Search from where the block's own message content starts, so equal text earlier cannot match.
            start = max(pos, (chat.content_spans[idx] or (0, 0))[0])
            at = text.find(piece, start)
            if at < 0:
                piece = piece.strip()  # templates that trim content
                at = text.find(piece, start)
            if at < 0:
                raise _err(400, "a cache_control block could not be located in the prompt", "anthropic")
            pos = at + len(piece)
            marks.append((pos, seconds))
        return chat, marks

    def _anthropic_usage(self, t: _Tenant, out: RequestOutput, claim_write: int, claim_read: int) -> dict[str, int]:
        """Usage as the group saw it: a read is at most what the group actually reused (an entry that outlived
        its blocks, e.g. after a group restart, reads nothing); what of the marked prefix was not read is a
        write, as far as the group could pin it."""
        n_prompt = len(out.prompt_token_ids)
        if not claim_write and not claim_read:  # no breakpoint: implicit reuse, reported per the tenant's policy
            read, write = self._reported_cached(t, out.num_cached_tokens), 0
        else:
            read = min(claim_read, out.num_cached_tokens)
            write = min(claim_read + claim_write - read, max(0, out.num_pinned_tokens - read))
            read += max(0, out.num_cached_tokens - read - write)  # reuse past the breakpoint, honestly
        return {"input_tokens": n_prompt - write - read, "cache_creation_input_tokens": write,
                "cache_read_input_tokens": read, "output_tokens": len(out.token_ids)}

    async def _anthropic_stream(self, t: _Tenant, run, mid: str, claim_write: int, claim_read: int):
        def event(kind: str, data: dict) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        try:
            first = True
            out = None
            async for out, _ in run:
                if first:  # the group has prefilled: its reuse is known
                    start_usage = {**self._anthropic_usage(t, out, claim_write, claim_read), "output_tokens": 0}
                    yield event("message_start", {"message": {
                        "id": mid, "type": "message", "role": "assistant", "model": self.model_id, "content": [],
                        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
                    yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    first = False
                if out.delta_text:
                    yield event("content_block_delta",
                                {"index": 0, "delta": {"type": "text_delta", "text": out.delta_text}})
            if out is not None:
                stop_seq = out.stop_reason if isinstance(out.stop_reason, str) else None
                yield event("content_block_stop", {"index": 0})
                yield event("message_delta", {"delta": {"stop_reason": _stop_reason(out), "stop_sequence": stop_seq},
                                              "usage": self._anthropic_usage(t, out, claim_write, claim_read)})
                yield event("message_stop", {})
        except ApiError as exc:
            yield event("error", {"error": {"type": exc.kind, "message": exc.message}})

    # -- cached content ----------------------------------------------------------------------------------------

    async def _pin_content(self, t: _Tenant, tokens: list[int], ttl: float, request: Request) -> None:
        """Compute and pin a cached content's tokens for ``ttl`` on a group, billed like a request: the prompt
        tokens, what was reused (a read) and what was computed and pinned (a write). Stopped if the client
        leaves."""
        run = self._generate(
            t, tokens, SamplingParams(max_tokens=1, temperature=0.0), "openai", len(tokens), ttl, _no_account, True)
        out, predicted = await _last(_watched(request, run, "openai"))
        read = min(out.num_cached_tokens, len(tokens))
        self.ledger.record(t.name, requests=1, prompt_tokens=len(tokens), cached_tokens=read,
                           output_tokens=len(out.token_ids), cache_read_tokens=read,
                           cache_write_tokens=len(tokens) - read)
        t.metrics.record(len(tokens), read, len(out.token_ids), predicted, out.num_cached_tokens)

    @routes.post("/{tenant}/v1/cachedContents")
    async def create_cached_content(self, tenant: str, request: Request):
        t = self._auth(tenant, request, "openai")
        return await self._held(t, "openai", self._create_cached_content(t, request))

    async def _create_cached_content(self, t: _Tenant, request: Request):
        body: CachedContentRequest = await self._body(request, CachedContentRequest, "openai")
        if body.model is not None:
            self._check_model(body.model.removeprefix("models/"), "openai")
        text = body.text
        if not text:
            raise _err(400, "contents: a cached content needs some text", "openai")
        ttl = self._ttl(t, body.ttl)
        tokens = self._chat([{"role": "system", "content": text}], "openai", generation=False).token_ids
        await self._admit(t, tokens, 1, "openai")
        limit = t.config.cache.max_pinned_tokens
        if limit is not None and len(tokens) > limit:
            raise _err(400, f"the content has {len(tokens)} tokens; this tenant may pin {limit}", "openai")
        store = self.contents[t.name]
        try:  # stored first: the tenant's limits refuse it before any compute is spent
            cc = await store.create(t.name, {"text": text}, tokens, ttl)
        except LimitExceeded as exc:
            raise _err(429, str(exc), "openai", 60.0) from None
        try:
            await self._pin_content(t, tokens, ttl, request)  # computed and pinned now, so the first use is a read
        except BaseException:
            self._spawn(store.delete(t.name, cc.id))
            raise
        return cc.public()

    def _ttl(self, t: _Tenant, ttl: str | None) -> float:
        try:
            seconds = parse_duration(ttl) if ttl else t.config.cache.default_ttl
        except ValueError as exc:
            raise _err(400, f"ttl: {exc}", "openai") from None
        if not 1.0 <= seconds <= MAX_CACHED_CONTENT_TTL_S:
            raise _err(400, f"ttl must be between 1s and {MAX_CACHED_CONTENT_TTL_S:.0f}s", "openai")
        return seconds

    @routes.get("/{tenant}/v1/cachedContents")
    async def list_cached_contents(self, tenant: str, request: Request):
        t = self._auth(tenant, request, "openai")
        return {"cachedContents": [c.public() for c in await self.contents[t.name].list(t.name)]}

    @routes.get("/{tenant}/v1/cachedContents/{cid}")
    async def get_cached_content(self, tenant: str, cid: str, request: Request):
        t = self._auth(tenant, request, "openai")
        cc = await self.contents[t.name].get(t.name, f"cachedContents/{cid}")
        if cc is None:
            raise _err(404, f"cached content {cid!r} not found", "openai")
        return cc.public()

    @routes.patch("/{tenant}/v1/cachedContents/{cid}")
    async def patch_cached_content(self, tenant: str, cid: str, request: Request):
        t = self._auth(tenant, request, "openai")
        return await self._held(t, "openai", self._patch_cached_content(t, cid, request))

    async def _patch_cached_content(self, t: _Tenant, cid: str, request: Request):
        body: CachedContentPatch = await self._body(request, CachedContentPatch, "openai")
        ttl = self._ttl(t, body.ttl)
        store = self.contents[t.name]
        cc = await store.get(t.name, f"cachedContents/{cid}")
        if cc is None:
            raise _err(404, f"cached content {cid!r} not found", "openai")
        await self._admit(t, cc.token_ids, 1, "openai")  # a re-pin costs what computing the content costs
        await self._pin_content(t, cc.token_ids, ttl, request)  # pinned for the new lifetime before it is promised
        cc = await store.set_ttl(t.name, f"cachedContents/{cid}", ttl)
        if cc is None:  # deleted meanwhile
            raise _err(404, f"cached content {cid!r} not found", "openai")
        return cc.public()

    @routes.delete("/{tenant}/v1/cachedContents/{cid}")
    async def delete_cached_content(self, tenant: str, cid: str, request: Request):
        t = self._auth(tenant, request, "openai")
        if not await self.contents[t.name].delete(t.name, f"cachedContents/{cid}"):
            raise _err(404, f"cached content {cid!r} not found", "openai")
        return {}

    # -- metrics -----------------------------------------------------------------------------------------------

    @routes.get("/{tenant}/metrics")
    async def metrics(self, tenant: str, request: Request):
        """This tenant's own counters only: worker-group load moves with every tenant's traffic, so it is on the
        admin API (``/admin/v1/metrics``), never here."""
        t = self._auth(tenant, request, "openai")
        return Response(generate_latest(t.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _healthz() -> Response:
    """For a load balancer in front of the frontend nodes: this replica serves (no tenant data)."""
    return Response("success", media_type="text/plain")


def create_app(gateway: Gateway, admin: FastAPI | None = None) -> FastAPI:
    """The gateway's ASGI app: every tenant's routes bound to ``gateway``, and the admin API under ``/admin``."""
    app = FastAPI(title="kvgrid gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StoreUnavailable, _store_unavailable)
    app.add_api_route("/-/healthz", _healthz, methods=["GET"], include_in_schema=False)
    if admin is not None:
        app.mount("/admin", admin)  # before the tenant routes: "/{tenant}/..." would take "/admin/..." too
    routes.include(app, gateway)
    return app
