"""What the gateway's three APIs share (router/gateway/openai_api.py, anthropic_api.py, cached_contents.py): the
``Gateway`` of one replica, which authenticates a tenant's key (in memory), reads and checks request bodies,
applies the tenant's limits (in-flight places, rate, prompt size), turns messages into a prompt (the chat
template, router/gateway/chat.py), asks a router replica for a worker group (hedged), streams the group's outputs
through its ``GroupClient`` (retrying a failed group elsewhere) and records usage. The tenant's own metrics
endpoint and the docs are here too; router/gateway/app.py builds the ASGI app from it all.

Errors are raised as ``ApiError``, which each API answers in its own format."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

import asyncio
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from functools import partial
from typing import Any, TypeVar

from fastapi import Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel
from ray.exceptions import RayActorError, RayError

from common.config import MonitoringConfig, ServeConfig, TenantConfig
from common.errors import GroupUnhealthyError, NoGroup, Overloaded, RequestAborted, RequestFailed, remote_cause
from common.model_config import ModelConfig, load_tokenizer, max_model_len
from common.outputs import RequestOutput, Timings, merge_choices
from common.protocol import Submit
from common.sampling import SamplingParams, StructuredOutput
from router.clients import RouterClient
from router.gateway.access import current as current_access
from router.gateway.chat import ChatPrompt, ChatTemplateError, encode_chat
from router.gateway.economics import Prices, RequestCost, dollars, request_cost
from router.gateway.keep_alive import KeepAlive
from router.gateway.monitoring import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    PHASE_BUCKETS,
    TTFT_BUCKETS,
    WINDOWS,
    Alert,
    DropAlarm,
    RequestTiming,
    ShareWindows,
)
from router.gateway.protocol import (
    MAX_BODY_BYTES,
    AnthropicError,
    AnthropicErrorDetail,
    BodyError,
    GeminiError,
    GeminiErrorDetail,
    OpenAIError,
    OpenAIErrorDetail,
    parse_body,
    ttl_seconds,
)
from router.gateway.replica_metrics import ReplicaMetrics, Source, tenant_extras
from router.gateway.routes import Routes
from router.gateway.store import (
    AlertLog,
    CachedContentStore,
    EntryStore,
    KeyRing,
    PromptSamples,
    RateLimiter,
    StoreUnavailable,
    UsageLedger,
    connect,
    presented_key,
)
from router.gateway.tracing import Tracing, current_trace, traced
from router.routing.router import RouteDecision
from worker.group_client import GroupClient

log = logging.getLogger(__name__)

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
SETTLE_S = 1.0  # a response waits this long for the cache-entry writes of its request
CLOSE_BACKGROUND_S = 2.0  # a stopping replica waits this long for its background Redis writes
# A router replica hears of its requests' first tokens and ends this late at most, in one call per interval: a
# call per event cost the router about as much CPU as routing (2 of its 3 calls a request; measured on 2 cores
# under 32 streams, the router's CPU per token fell from 66-72 to 43-46 us without them).
REPORT_INTERVAL_S = 0.05
# CPU-heavy work of a request (tokenizing, chat templates, grammar checks, building and serialising a large answer)
# runs in a pool of this many threads, never on the event loop; a tenant occupies at most CPU_SHARE of them, so
# another tenant finds one. Tokenizing happens in Rust without the GIL (measured: 2 Mi characters tokenized
# in a thread held the loop for 0.2 s at most, converting the offsets; on the loop itself, 2-3 s).
CPU_WORKERS = max(2, min(4, os.cpu_count() or 2))
CPU_SHARE = max(1, CPU_WORKERS // 2)
# Shorter texts are tokenized on the loop: a chat template and tokenizing take 1-2 ms there (measured on 2 busy
# cores), a queue behind other tenants' jobs in the pool could take longer.
INLINE_CHARS = 1024
# A token covers at most the characters of its longest vocabulary entry; a normalizer may compose up to this many
# characters into one (NFC: a Hangul syllable, a letter and its accents) before that.
NORMALIZED_CHARS = 4
# What the error of a request the engine failed on its grammar says (worker/structured.py GrammarError): a 400,
# worded here, not the grammar engine's internals.
GRAMMAR_FAILED = "GrammarError: "

routes = Routes()  # the shared endpoints (docs, a tenant's metrics), bound to one Gateway by create_app
# This request's chat prompt (messages, generation prompt, token ids, tools), which ``admit`` samples for the cache
# advisor: each request runs in its own task, so its own.
_CHAT: ContextVar[tuple[list[dict[str, Any]], bool, list[int], list[dict] | None] | None] = ContextVar(
    "kvgrid_chat", default=None
)
# The pin TTL of the request ``generate`` is accounting (set just before it calls ``account``).
_PIN_TTL: ContextVar[float | None] = ContextVar("kvgrid_pin_ttl", default=None)

T = TypeVar("T")


# -- errors ----------------------------------------------------------------------------------------------------


class GroupFailed(Exception):
    """The worker group running a request failed (died, lost a rank, or went silent): retried elsewhere."""


# The Gemini API's error status names (google.rpc.Code) for the HTTP statuses the gateway answers.
_GEMINI_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    503: "UNAVAILABLE",
}


class ApiError(Exception):
    """An error answered in the calling API's own format (``api``: "openai", "anthropic" or "gemini")."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        api: str = "openai",
        retry_after: float = 1.0,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.api = status, message, kind, api
        self.retry_after = retry_after

    def body(self) -> BaseModel:
        if self.api == "anthropic":
            return AnthropicError(error=AnthropicErrorDetail(type=self.kind, message=self.message))
        if self.api == "gemini":
            status = _GEMINI_STATUS.get(self.status, "INTERNAL" if self.status >= 500 else "FAILED_PRECONDITION")
            return GeminiError(error=GeminiErrorDetail(code=self.status, message=self.message, status=status))
        return OpenAIError(error=OpenAIErrorDetail(message=self.message, type=self.kind, code=self.status))

    def response(self) -> Response:
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))} if self.status in (429, 503) else None
        return Response(
            self.body().model_dump_json(), status_code=self.status, headers=headers, media_type="application/json"
        )


_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def err(status: int, message: str, api: str, retry_after: float = 1.0) -> ApiError:
    """The error of ``status`` in ``api``'s wording (its error type for the status)."""
    kind = _KINDS.get(status, "api_error")
    if api == "openai" and status == 401:
        kind = "invalid_request_error"
    return ApiError(status, message, kind, api, retry_after)


async def api_error(_: Request, exc: ApiError) -> Response:
    return exc.response()


async def store_unavailable(request: Request, exc: StoreUnavailable) -> Response:
    """Redis is down or slow: what needs it answers a retryable 503 at once instead of waiting (in the format
    of the API that ``Gateway.auth`` admitted the request to)."""
    api = getattr(request.state, "api", "openai")
    return err(503, "the service's state store is unavailable; retry shortly", api, STORE_RETRY_AFTER_S).response()


def group_failure(exc: Exception, group: str, api: str) -> Exception:
    """What a failed output of a group means: a bad request (400), an abort (503), the group itself failing (a
    retry elsewhere), or an error of this one request (500; the group keeps serving everyone else)."""
    if isinstance(exc, ValueError):
        return err(400, str(exc), api)
    if isinstance(exc, RequestAborted):
        return err(503, "the request was aborted on its worker group; retry it", api)
    if isinstance(exc, RequestFailed) and GRAMMAR_FAILED in str(exc):  # a grammar the gateway's checks let by
        return err(
            400,
            "the structured output (response_format or a forced tool call) is too complex for the grammar engine; "
            "simplify its schema",
            api,
        )
    if isinstance(exc, RequestFailed):  # the engine failed this request alone; its group keeps serving
        return ApiError(
            500,
            f"the request failed on worker group {group} ({exc}); the service keeps serving, "
            "retry it or change its parameters",
            "api_error",
            api,
        )
    if isinstance(exc, GroupUnhealthyError):
        return GroupFailed(f"{type(exc).__name__}: {exc}")
    return ApiError(500, f"internal error in worker group {group} ({type(exc).__name__})", "api_error", api)


# -- a tenant in this replica ----------------------------------------------------------------------------------


class _Metrics:
    """A tenant's Prometheus metrics in this replica: traffic and cache counters, cost at its prices, the cache-read
    share over recent windows, latency histograms and the hit-rate drop alarm (router/gateway/monitoring.py), each
    labelled ``tenant`` and ``model_name`` (the served model id, as vLLM labels its series). ``GET /{tenant}/metrics``
    shows them merged over every gateway replica (router/gateway/replica_metrics.py).

    vLLM's names for the same figures (kvgrid keeps its own; a query can be written for either):
    ``kvgrid_requests_total`` ~ ``vllm:request_success_total`` (summed over ``finished_reason``),
    ``kvgrid_prompt_tokens_total`` ~ ``vllm:prompt_tokens_total``, ``kvgrid_output_tokens_total`` ~
    ``vllm:generation_tokens_total``, ``kvgrid_cached_tokens_total`` / ``kvgrid_prompt_tokens_total`` ~
    ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (tokens; vLLM counts the engine's
    lookups, kvgrid the reuse billed to the tenant), ``kvgrid_time_to_first_token_seconds``,
    ``kvgrid_inter_token_latency_seconds`` and ``kvgrid_e2e_request_latency_seconds`` ~ vLLM's
    ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (formerly
    ``vllm:time_per_output_token_seconds``) and ``vllm:e2e_request_latency_seconds`` (the same buckets; measured at
    the gateway, so they include routing and the network to the group). ``kvgrid_request_queue_time_seconds``,
    ``kvgrid_request_prefill_time_seconds`` and ``kvgrid_request_decode_time_seconds`` ~
    ``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds`` and
    ``vllm:request_decode_time_seconds`` (the engine's own clock: common/outputs.py ``Timings``; an ``n`` > 1 request
    once, from its first choice scheduled to its last finished). ``kvgrid_prefix_cache_hit_tokens_total{tier}``
    (tier ``gpu``, ``host`` or ``disk``) ~ ``vllm:prefix_cache_hits_total`` split by where the reused blocks were:
    the tokens the group reused (its report), split by the tiers the router found them in at routing time (the
    host and disk parts capped at the reuse, the GPU part the rest); a tier's hit rate is its rate over
    ``rate(kvgrid_prompt_tokens_total)``."""

    def __init__(
        self, tenant: str, block_size: int = 16, monitoring: MonitoringConfig | None = None, model_name: str = ""
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lbl = self.registry, ["tenant", "model_name"]
        self.requests = Counter("kvgrid_requests", "Requests served", lbl, registry=r)
        self.prompt = Counter("kvgrid_prompt_tokens", "Prompt tokens", lbl, registry=r)
        self.cached = Counter("kvgrid_cached_tokens", "Prompt tokens served from the prefix cache", lbl, registry=r)
        self.output = Counter("kvgrid_output_tokens", "Output tokens", lbl, registry=r)
        self.hit_rate = Gauge("kvgrid_prefix_hit_rate", "Cached / prompt tokens so far", lbl, registry=r)
        self.predicted = Counter(
            "kvgrid_router_predicted_cached_tokens", "Cached tokens the router expected", lbl, registry=r
        )
        self.actual = Counter("kvgrid_router_actual_cached_tokens", "Cached tokens the group reported", lbl, registry=r)
        self.writes = Counter("kvgrid_cache_write_tokens", "Prompt tokens written to explicit entries", lbl, registry=r)
        self.cost = Counter("kvgrid_cost_dollars", "What the traffic cost at the tenant's prices", lbl, registry=r)
        self.uncached_cost = Counter(
            "kvgrid_cost_without_cache_dollars", "The same traffic's cost without the cache", lbl, registry=r
        )
        self.window_rate = Gauge(
            "kvgrid_prefix_hit_rate_window", "Cached / prompt tokens over the last window", [*lbl, "window"], registry=r
        )
        self.ttft = Histogram(
            "kvgrid_time_to_first_token_seconds", "Time to first token", lbl, registry=r, buckets=TTFT_BUCKETS
        )
        self.itl = Histogram(
            "kvgrid_inter_token_latency_seconds", "Time between output tokens", lbl, registry=r, buckets=ITL_BUCKETS
        )
        self.e2e = Histogram(
            "kvgrid_e2e_request_latency_seconds", "End-to-end request latency", lbl, registry=r, buckets=E2E_BUCKETS
        )
        self.queue = Histogram(
            "kvgrid_request_queue_time_seconds", "Time waiting in the group", lbl, registry=r, buckets=PHASE_BUCKETS
        )
        self.prefill = Histogram(
            "kvgrid_request_prefill_time_seconds", "Prefill time", lbl, registry=r, buckets=PHASE_BUCKETS
        )
        self.decode = Histogram(
            "kvgrid_request_decode_time_seconds", "Decode time", lbl, registry=r, buckets=PHASE_BUCKETS
        )
        self.tier_hits = Counter(
            "kvgrid_prefix_cache_hit_tokens", "Prompt tokens the group reused, by KV tier", [*lbl, "tier"], registry=r
        )
        self.alerts = Counter("kvgrid_hit_rate_drop_alerts", "Hit-rate drop alerts", lbl, registry=r)
        self.alert_active = Gauge("kvgrid_hit_rate_drop_active", "1 during a hit-rate drop", lbl, registry=r)
        self.alert_block = Gauge(
            "kvgrid_hit_rate_drop_block", "The block where prompts stopped matching (last alert)", lbl, registry=r
        )
        self.tenant = tenant
        mon = monitoring or MonitoringConfig()
        self.alarm: DropAlarm | None = None
        if mon.drop_alerts:
            self.alarm = DropAlarm(
                tenant, block_size, mon.window, mon.baseline, mon.drop_ratio, mon.min_share, streak=mon.streak
            )
        self.windows = self.alarm.windows if self.alarm is not None else ShareWindows()
        self.clock = time.time  # the alarm's clock (a test's simulated one)
        self._prompt_total = self._cached_total = 0
        self.last_alert: Alert | None = None  # this replica's newest (its time decides the merged drop block)
        # Every series shows from the start, at 0; the children are kept (a labels() lookup per use costs more).
        self._n = {
            name: getattr(self, name).labels(tenant, model_name)
            for name in (
                *("requests", "prompt", "cached", "output", "predicted", "actual", "writes", "cost"),
                *("uncached_cost", "alerts", "hit_rate", "alert_active", "alert_block", "ttft", "itl", "e2e"),
                *("queue", "prefill", "decode"),
            )
        }
        self._windows = {w: self.window_rate.labels(tenant, model_name, w) for w in WINDOWS}
        self._tiers = {tier: self.tier_hits.labels(tenant, model_name, tier) for tier in ("gpu", "host", "disk")}

    def record(
        self,
        prompt: int,
        cached: int,
        output: int,
        predicted: int,
        actual: int,
        prompt_ids: list[int] | None = None,
        cost: RequestCost | None = None,
        write: int = 0,
        now: float | None = None,
    ) -> Alert | None:
        """``cached``: the reuse reported to the client (the tenant's policy); ``actual``: what the group reused,
        against which the router's ``predicted`` is judged. The alarm's alert when this request starts a drop."""
        n = self._n
        n["requests"].inc()
        n["prompt"].inc(prompt)
        n["cached"].inc(cached)
        n["output"].inc(output)
        n["predicted"].inc(predicted)
        n["actual"].inc(actual)
        n["writes"].inc(write)
        if cost is not None:
            n["cost"].inc(dollars(cost.cost))
            n["uncached_cost"].inc(dollars(cost.uncached_cost))
        self._prompt_total += prompt
        self._cached_total += cached
        n["hit_rate"].set(self._cached_total / max(1, self._prompt_total))
        now = self.clock() if now is None else now
        alert = None
        if self.alarm is not None:
            alert = self.alarm.observe(prompt_ids if prompt_ids is not None else [0] * prompt, cached, now)
            n["alert_active"].set(0 if self.alarm.active is None else 1)
        else:
            self.windows.add(now, prompt, cached)
        for w, seconds in WINDOWS.items():
            self._windows[w].set(self.windows.share(now, seconds))
        if alert is not None:
            n["alerts"].inc()
            n["alert_block"].set(alert.block)
            self.last_alert = alert
        return alert

    def observe(self, timing: RequestTiming) -> None:
        """A finished request's latencies."""
        if timing.ttft is not None:
            self._n["ttft"].observe(timing.ttft)
        itl = self._n["itl"]
        for gap in timing.gaps:
            itl.observe(gap)
        if timing.e2e is not None:
            self._n["e2e"].observe(timing.e2e)

    def observe_group(self, timings: list[Timings], reused: int, host: int, disk: int) -> None:
        """A finished request's time in its group (the ``Timings`` of each choice's final output: queue, prefill,
        decode) and the ``reused`` prompt tokens of it, of which the router found up to ``host`` in host RAM and up
        to ``disk`` on disk."""
        scheduled = min((t.scheduled for t in timings if t.scheduled is not None), default=None)
        first = min((t.first_token for t in timings if t.first_token is not None), default=None)
        if timings:
            finished = max(t.finished for t in timings)
            self._n["queue"].observe(finished if scheduled is None else scheduled)
            if scheduled is not None:
                self._n["prefill"].observe(max(0.0, (finished if first is None else first) - scheduled))
                if first is not None:
                    self._n["decode"].observe(max(0.0, finished - first))
        if reused > 0:
            disk = min(disk, reused)
            host = min(host, reused - disk)
            self._tiers["gpu"].inc(reused - host - disk)
            self._tiers["host"].inc(host)
            self._tiers["disk"].inc(disk)


class Tenant:
    """One tenant's state in this replica: its config, rate limiter, metrics and in-flight count."""

    def __init__(
        self,
        config: TenantConfig,
        limiter: RateLimiter,
        block_size: int = 16,
        monitoring: MonitoringConfig | None = None,
        model_name: str = "",
    ) -> None:
        self.name, self.config = config.name, config
        self.limiter = limiter
        self.metrics = _Metrics(config.name, block_size, monitoring, model_name)
        self.prices = Prices.from_config(config.prices)
        self.inflight = 0


class _Slot:
    """One of a tenant's in-flight places in this replica; released exactly once."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant, self.held = tenant, True
        tenant.inflight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.tenant.inflight -= 1


class SlotStream(StreamingResponse):
    """A streamed answer (server-sent events) that holds its request's in-flight slot until the stream ends,
    however it ends."""

    slot: _Slot | None = None

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.slot is not None:
                self.slot.release()


# -- a request's outputs ---------------------------------------------------------------------------------------

# A request's outputs, each with the tokens the router expected cached.
Run = AsyncGenerator[tuple[RequestOutput, int], None]
Account = Callable[[RequestOutput, int], None]  # records a request's usage from its last output once it ended


def no_account(out: RequestOutput, predicted: int) -> None:
    """Internal requests (computing cached content) are recorded by their callers."""


async def primed(run: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Start ``run`` now (so its first error surfaces before a response is sent) and return an equivalent."""
    first = await run.__anext__()

    async def rest() -> AsyncGenerator[T, None]:
        try:
            yield first
            async for item in run:
                yield item
        finally:  # a stream cut short stops ``run`` now, not when the collector gets to it
            await run.aclose()

    return rest()


async def last(run: Run) -> tuple[RequestOutput, int]:
    final = None
    async for out in run:
        final = out
    assert final is not None
    return final


async def _client_gone(request: Request) -> None:
    """Returns when the client has disconnected (the body was read already: the next message is the
    disconnect)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the connection state cannot be read: never cut a request on that
        await asyncio.Event().wait()


async def watched(request: Request, run: AsyncGenerator[T, None], api: str) -> AsyncGenerator[T, None]:
    """``run``'s items until the client disconnects; then ``run`` is stopped (its group request aborted) and a
    499 raised, whatever headers the client sent.

    The disconnect cancels the task waiting for ``run``'s next item, if one is (the task reading this
    generator, whichever it is at the time); a disconnect while the reader is elsewhere (writing the last item
    out) is raised when it asks for the next one. No task per item: a stream's tokens cost one await each."""
    gone = asyncio.ensure_future(_client_gone(request))
    waiting: asyncio.Task | None = None  # the task awaiting run's next item, while one is
    left = False

    def on_gone(f: asyncio.Future) -> None:
        nonlocal left
        if f.cancelled():
            return
        left = True
        if waiting is not None:
            waiting.cancel()

    gone.add_done_callback(on_gone)
    try:
        while True:
            if left:
                raise err(499, "the client closed the request", api)
            waiting = asyncio.current_task()
            try:
                item = await run.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                # Ours (the client left) unless the task was also cancelled by someone else: that one goes on.
                if not left or waiting is None or waiting.uncancel() > 0:
                    raise
                raise err(499, "the client closed the request", api) from None
            finally:
                waiting = None
            yield item
    finally:
        gone.remove_done_callback(on_gone)
        gone.cancel()
        await run.aclose()


class RouterReports:
    """Request events for the router replicas (``"prefill_done"``, ``"finish"``), in order, one ``report`` call
    per replica every ``REPORT_INTERVAL_S`` while there are any."""

    def __init__(self, interval_s: float = REPORT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._pending: dict[int, tuple[RouterClient, list[tuple[str, str]]]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, router: RouterClient, kind: str, request_id: str) -> None:
        entry = self._pending.get(id(router))
        if entry is None:
            entry = self._pending[id(router)] = (router, [])
        entry[1].append((kind, request_id))
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.interval_s, self.flush)
            except RuntimeError:  # no loop any more (a request collected at shutdown): say it now
                self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, {}
        for router, events in pending.values():
            router.report(events)


class HedgeBudget:
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


async def _outputs(client: GroupClient, req: Submit, api: str) -> AsyncGenerator[RequestOutput, None]:
    """A group's outputs for one request, its errors as the gateway answers them. A request may wait in a busy
    group's queue for long, so silence alone is no failure: every ``GROUP_SILENCE_S`` without output the leader
    is asked whether the group is healthy (a hung step fails it after ``step_timeout_s``); a group that is
    unhealthy or does not answer has failed."""

    async def silent() -> None:
        try:
            reason = await client.ahealth(HEALTH_TIMEOUT_S)
        except (GroupUnhealthyError, TimeoutError) as exc:
            reason = (
                f"no output for {GROUP_SILENCE_S:.0f} s and no health answer ({type(exc.__cause__ or exc).__name__})"
            )
        if reason is not None:
            raise GroupFailed(reason)

    stream = client.astream(req, silent, GROUP_SILENCE_S)
    try:
        async for out in stream:
            yield out
    except GroupFailed:
        raise
    except Exception as exc:
        raise group_failure(exc, client.group, api) from None
    finally:  # a consumer that stops early aborts the request now, not when the stream is collected
        await stream.aclose()


def _chars_per_token(tokenizer) -> int:
    """The most characters of a text that one token can cover: its longest vocabulary entry (a byte-level entry's
    characters are bytes, at least as many as the text's characters), times ``NORMALIZED_CHARS`` when a normalizer
    may first compose several characters into one."""
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = backend is not None and backend.normalizer is None
    return max(1, longest) * (1 if plain else NORMALIZED_CHARS)


class CpuPool:
    """The threads that do a replica's CPU-heavy request work off its event loop, shared fairly: a tenant runs at
    most ``per_tenant`` jobs at once (its further jobs wait for one of its own to end), so with ``per_tenant`` below
    ``workers`` no tenant alone occupies every worker, and the queue in front of them holds at most ``per_tenant``
    jobs of each tenant. A job counts against its tenant until its thread is done with it, also when the request
    that waited for it has gone."""

    def __init__(self, workers: int, per_tenant: int, initializer: Callable[[], None] | None = None) -> None:
        self.workers, self.per_tenant = workers, per_tenant
        self._executor = ThreadPoolExecutor(workers, "kvgrid-cpu", initializer=initializer)
        self._shares: dict[str, asyncio.Semaphore] = {}

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        share = self._shares.get(tenant)
        if share is None:
            share = self._shares[tenant] = asyncio.Semaphore(self.per_tenant)
        await share.acquire()
        loop = asyncio.get_running_loop()
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            share.release()
            raise

        def done(_: object) -> None:
            try:
                loop.call_soon_threadsafe(share.release)
            except RuntimeError:  # the loop has closed: nothing waits for the share any more
                pass

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    def close(self) -> None:
        """Drop the jobs not started; the running ones end on their own (the threads are not waited for)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


# -- the gateway -----------------------------------------------------------------------------------------------


class Gateway:
    """One gateway replica's state and what every API does with it (``config`` has no API keys, ``keys`` their
    hashes). ``routers``: the RouterService replicas' clients; a request stays with the replica that routed it."""

    def __init__(
        self, config: ServeConfig, keys: KeyRing, model_path: str, routers: Sequence[RouterClient], redis_url: str
    ) -> None:
        self.config = config
        self.model_id = config.model_id
        self.keys = keys
        # The event loop's tokenizer: no other thread uses it (a transformers tokenizer keeps per-call settings on
        # itself, such as whether special-token text is matched); each thread of ``cpu`` loads its own.
        self.tokenizer = load_tokenizer(model_path)
        self._local = threading.local()
        self.cpu = CpuPool(CPU_WORKERS, CPU_SHARE, lambda: self._load_thread_tokenizer(model_path))
        self.chars_per_token = _chars_per_token(self.tokenizer)
        # Token ids a prompt may hold: below this. Read once: len() of a transformers tokenizer rebuilds its whole
        # vocabulary (a per-token check with it cost about 1 ms per 2k-token prompt).
        self.vocab_size = len(self.tokenizer)
        mcfg = ModelConfig.from_folder(model_path)
        self.max_model_len = max_model_len(mcfg, config.max_model_len)  # the same limit the engine enforces
        self.routers = [RouterClient.of(r) for r in routers]
        self._next_router = secrets.randbelow(len(self.routers))
        self._router_failed_at = [-math.inf] * len(self.routers)
        self._hedges = HedgeBudget()
        self.reports = RouterReports()
        self.redis = connect(redis_url, config.redis_timeout_s)
        self.ledger = UsageLedger(self.redis)
        self.alerts = AlertLog(self.redis)
        self.samples = PromptSamples(self.redis)
        self.entries = EntryStore(self.redis)
        self.contents = {
            t.name: CachedContentStore(self.redis, t.limits.max_cached_contents, t.limits.max_cached_content_tokens)
            for t in config.tenants
        }
        self.tenants = {
            t.name: Tenant(
                t,
                RateLimiter(self.redis, t.limits.requests_per_s, t.limits.tokens_per_min),
                config.block_size,
                config.monitoring,
                config.model_id,
            )
            for t in config.tenants
        }
        # The same request counters without the token ones: what a request that generates nothing (count_tokens)
        # counts against.
        self._request_rates = {t.name: RateLimiter(self.redis, t.limits.requests_per_s, None) for t in config.tenants}
        self._background: set[asyncio.Task] = set()
        self._clients: dict[str, GroupClient] = {}  # group -> the client of its leader (this replica's subscription)
        # keep_alive: auto tenants' entries (router/gateway/keep_alive.py)
        self.keep_alive = KeepAlive(self.redis, self.tenants, self.spawn, self.ledger, self.repin)
        self.keep_alive.start()
        # Each tenant's metrics published to Redis every second and merged over the replicas at a scrape
        # (router/gateway/replica_metrics.py); created after KeepAlive, whose counters are in the same registries.
        self.replica_metrics = ReplicaMetrics(
            self.redis,
            {name: Source(t.metrics.registry, partial(tenant_extras, t.metrics)) for name, t in self.tenants.items()},
        )
        self.metrics_on = config.metrics.enabled  # off: no metric updates per request, no publishing
        if self.metrics_on:
            self.replica_metrics.start()
        # OpenTelemetry traces of the requests (router/gateway/tracing.py): None without ``tracing`` in the config.
        self.tracing = Tracing.start(config.tracing)

    async def close(self) -> None:
        """When the replica stops, on the loop that served it: let the background writes started by finished
        requests (cache entries, deletes) end, write the usage still buffered (Redis permitting), close Redis."""
        await self.keep_alive.close()
        self.cpu.close()
        self.reports.flush()
        if self._background:
            await asyncio.wait(set(self._background), timeout=CLOSE_BACKGROUND_S)
        try:
            await self.ledger.close()
        except StoreUnavailable:
            log.warning("usage not yet written to Redis was lost at shutdown")
        if self.metrics_on:
            await self.replica_metrics.close()  # its last samples; its counters stay in the totals
        await self.redis.aclose()
        if self.tracing is not None:  # the spans still buffered go out (a collector that is gone: SHUTDOWN_S)
            await asyncio.to_thread(self.tracing.shutdown)

    # -- admission ---------------------------------------------------------------------------------------------

    def auth(self, tenant: str, request: Request, api: str) -> Tenant:
        """The tenant, if the request carries one of its keys (``presented_key``). An unknown tenant gets the very
        same 401 as a wrong key, so tenant names cannot be probed. Every route calls this first: the request's
        errors from here on are in ``api``'s format."""
        request.state.api = api
        with traced("auth"):
            t = self.tenants.get(tenant)
            ok = self.keys.authenticate(tenant, presented_key(request.headers))  # hashed either way: same timing
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

    async def held(self, t: Tenant, api: str, work: Coroutine[Any, Any, T]) -> T:
        """Run the coroutine ``work`` in one of the tenant's in-flight places in this replica (429 when all are
        taken); a streamed answer (``SlotStream``) keeps the place until its stream ends."""
        limit = t.config.limits.max_inflight_requests
        if t.inflight >= limit:
            work.close()
            raise err(
                429,
                f"this tenant has {limit} requests in flight (limits.max_inflight_requests); retry "
                "when one has finished",
                api,
            )
        slot: _Slot | None = _Slot(t)
        try:
            result = await work
            if isinstance(result, SlotStream):
                result.slot, slot = slot, None
            return result
        finally:
            if slot is not None:
                slot.release()

    def check_model(self, model: str, api: str) -> None:
        if model != self.model_id:
            raise err(404, f"model {model!r} does not exist; this gateway serves {self.model_id!r}", api)

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

    async def admit(self, t: Tenant, prompt: list[int], max_tokens: int, api: str) -> None:
        """Check the prompt's length and the tenant's limits before any work is done for it."""
        if not prompt:
            raise err(400, "the prompt is empty", api)
        self.check_size(t, len(prompt), max_tokens, api)
        retry_after = await t.limiter.admit(t.name, len(prompt) + max_tokens)
        if retry_after is not None:
            raise err(429, "rate limit reached for this tenant; retry later", api, retry_after)
        self.sample(t, prompt)

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

    def check_chars(self, t: Tenant, chars: int, api: str) -> None:
        """413 for a prompt that ``chars`` characters of its text make longer than ``check_size`` takes, before it is
        tokenized: no token covers more than ``chars_per_token`` of them, so it has more tokens than that."""
        lim = t.config.limits
        tokens = min(n for n in (self.max_model_len - 1, lim.max_prompt_tokens, lim.tokens_per_min) if n is not None)
        if chars > tokens * self.chars_per_token:
            raise err(
                413,
                f"the prompt has {chars} characters: more than {tokens} tokens hold (one holds at most "
                f"{self.chars_per_token} characters here; the context is {self.max_model_len} tokens)",
                api,
            )

    async def admit_request(self, t: Tenant, api: str) -> None:
        """Count a request that generates nothing (count_tokens) against the tenant's request rate: 429 past it."""
        retry_after = await self._request_rates[t.name].admit(t.name, 0)
        if retry_after is not None:
            raise err(429, "rate limit reached for this tenant; retry later", api, retry_after)

    def sample(self, t: Tenant, prompt: list[int]) -> None:
        """Keep an admitted prompt in the tenant's advisor sample (``advice: {sample: N}``; off by default): the
        messages ``chat`` rendered it from in this request, else its token ids. Best effort, in the background."""
        keep = t.config.advice.sample
        chat = _CHAT.get()
        _CHAT.set(None)
        if not keep:
            return
        row: dict[str, Any] = {"t": time.time()}
        if chat is not None and len(chat[2]) <= len(prompt) and prompt[len(prompt) - len(chat[2]) :] == chat[2]:
            row.update(messages=chat[0], gen=chat[1], prefix=len(prompt) - len(chat[2]))
            if chat[3]:
                row["tools"] = chat[3]
        else:
            row["token_ids"] = prompt
        self.spawn(self.samples.add(t.name, row, keep, t.config.advice.ttl))

    # -- prompts and parameters --------------------------------------------------------------------------------

    def _load_thread_tokenizer(self, model_path: str) -> None:
        self._local.tokenizer = load_tokenizer(model_path)

    def thread_tokenizer(self):
        """The tokenizer of the calling thread: a ``cpu`` worker's own, else the event loop's."""
        tokenizer = getattr(self._local, "tokenizer", None)
        return self.tokenizer if tokenizer is None else tokenizer

    async def compute(self, t: Tenant, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """``fn(*args)`` in the tenant's share of the worker pool (``CpuPool``); on the loop when ``inline`` (work too
        small to be worth a thread)."""
        return fn(*args) if inline else await self.cpu.run(t.name, fn, *args)

    async def encode_text(self, t: Tenant, text: str, api: str) -> list[int]:
        """A completion's text prompt as token ids (special-token text matched: it is the caller's own template);
        413 at once for one too long by its characters alone."""
        self.check_chars(t, len(text), api)
        with traced("tokenize") as span:
            ids = await self.compute(t, self._encode_text, text, inline=len(text) <= INLINE_CHARS)
            if span is not None:
                span.set_attribute("kvgrid.prompt_tokens", len(ids))
        return ids

    def _encode_text(self, text: str) -> list[int]:
        return self.thread_tokenizer().encode(text, add_special_tokens=False)

    async def chat(
        self,
        t: Tenant,
        messages: list[dict[str, Any]],
        api: str,
        generation: bool = True,
        tools: list[dict] | None = None,
    ) -> ChatPrompt:
        """The chat template applied to ``messages`` (every API's one way to a chat prompt), with ``tools`` (function
        definitions, router/gateway/tools.py); their texts never become special tokens (router/gateway/chat.py).
        Messages too long for the tenant by their characters alone get 413 before the template; the rest is
        rendered and tokenized in the worker pool unless it is short."""
        chars = sum(len(m["content"].strip()) for m in messages if isinstance(m.get("content"), str))
        self.check_chars(t, chars, api)
        inline = chars <= INLINE_CHARS and not tools and not any(m.get("tool_calls") for m in messages)
        rt = current_trace()
        marks: list[int] | None = None if rt is None else []  # traced: when templating and tokenizing ran
        prompt: ChatPrompt | None = None
        try:
            prompt = await self.compute(t, self._encode_chat, messages, generation, tools, marks, inline=inline)
        except ChatTemplateError as exc:
            raise err(400, f"messages: {exc}", api) from None
        finally:
            if rt is not None and marks:
                rt.chat_spans(marks, None if prompt is None else len(prompt.token_ids))
        _CHAT.set((messages, generation, prompt.token_ids, tools))  # for the advisor's sample (``sample``)
        return prompt

    def _encode_chat(
        self,
        messages: list[dict[str, Any]],
        generation: bool,
        tools: list[dict] | None = None,
        marks: list[int] | None = None,
    ) -> ChatPrompt:
        if marks is not None:
            marks.append(time.time_ns())
        prompt = encode_chat(
            self.thread_tokenizer(), messages, add_generation_prompt=generation, tools=tools, marks=marks
        )
        if marks is not None:
            marks.append(time.time_ns())
        return prompt

    async def cached_prefix(self, t: Tenant, cid: str | None, api: str) -> tuple[list[int], float]:
        """Token ids and remaining TTL of a referenced cached content object."""
        if cid is None:
            return [], 0.0
        name = cid if cid.startswith("cachedContents/") else f"cachedContents/{cid}"
        cc = await self.contents[t.name].get(t.name, name)
        if cc is None:
            raise err(404, f"cached content {cid!r} not found", api)
        return cc.token_ids, max(1.0, cc.expires - time.time())

    def params(
        self,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop: list[str] | None,
        seed: int | None,
        api: str,
        top_k: int = 0,
        ignore_eos: bool = False,
        structured_output: StructuredOutput | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop_token_ids: list[int] | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                repetition_penalty=repetition_penalty,
                stop=stop or [],
                stop_token_ids=stop_token_ids or [],
                seed=seed,
                ignore_eos=ignore_eos,
                structured_output=structured_output,
            )
        except ValueError as exc:
            raise err(400, str(exc), api) from None

    # -- routing and running -----------------------------------------------------------------------------------

    async def _route(
        self,
        t: Tenant,
        prompt: list[int],
        attempt: str,
        failed: list[str],
        api: str,
        cache_key: str | None = None,
        n: int = 1,
    ) -> tuple[RouterClient, RouteDecision]:
        """(router replica, decision) from the first replica that routes the request. Hedged: a replica that has
        not answered within ``HEDGE_DELAY_S`` is not waited on alone, the next one is asked too (once per
        request, within ``HEDGE_BUDGET``), and the first decision wins; every other replica asked cancels the
        route (it may have made it too: its load, predictions and recent prefill are undone), so no replica
        counts the request but the one that serves it. A dead, restarting or stuck replica is skipped, and so is
        one that knows no group yet (just restarted: the supervisor hands it the groups within a second). 503
        when none routes it (a retry a moment later works)."""
        replicas = len(self.routers)  # (not ``n``: that is the request's choices, which the router counts)
        self._next_router = (self._next_router + 1) % replicas
        self._hedges.earn()
        now = time.monotonic()
        order = sorted(
            ((self._next_router + i) % replicas for i in range(replicas)),  # round robin, recent failures last
            key=lambda j: now - self._router_failed_at[j] < ROUTER_COOLDOWN_S,
        )
        pending: dict[asyncio.Future, int] = {}  # call -> position in ``order``
        asked = 0  # replicas asked so far: order[:asked]
        hedged = False
        no_group: str | None = None
        won: int | None = None

        def ask() -> None:
            nonlocal asked
            timeout_s = ROUTE_TIMEOUT_S if asked < replicas - 1 else LAST_ROUTE_TIMEOUT_S
            call = self.routers[order[asked]].route(t.name, prompt, attempt, failed, cache_key, n)
            pending[asyncio.ensure_future(_bounded(call, timeout_s))] = asked
            asked += 1

        ask()
        try:
            while pending:
                hedge = HEDGE_DELAY_S if asked < replicas and not hedged else None
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
                            self.routers[order[k]].cancel_route(attempt)
                    return self.routers[order[won]], winner.result()
                for call in done:
                    j = order[pending.pop(call)]
                    try:
                        call.result()
                    except (TimeoutError, RayActorError):
                        self._router_failed_at[j] = time.monotonic()
                        self.routers[j].cancel_route(attempt)  # in case it did route it
                    except RayError as exc:
                        cause = remote_cause(exc)
                        if isinstance(cause, Overloaded):
                            raise err(429, f"overloaded: {cause}; retry shortly", api) from None
                        no_group = str(cause) if isinstance(cause, NoGroup) else type(exc).__name__
                if asked < replicas:
                    ask()  # what came back were failures: the next replica, without waiting
        finally:
            # The others asked (all of them when the client left or no decision came): they may have routed the
            # request, so they cancel it. One asked before the winner and still silent is slow or dead (a killed
            # replica holds calls until Ray has restarted it): it is tried last for a while.
            for call, k in pending.items():
                call.cancel()
                call.add_done_callback(lambda c: c.cancelled() or c.exception())  # its late failure is expected
                self.routers[order[k]].cancel_route(attempt)
                if won is not None and k < won:
                    self._router_failed_at[order[k]] = time.monotonic()
        if no_group is not None:
            raise err(503, f"no worker group available ({no_group}); retry shortly", api)
        raise err(503, "no router replica is available; retry shortly", api, ROUTER_RETRY_AFTER_S)

    def _client(self, decision: RouteDecision) -> GroupClient:
        """The client of the decision's group, whose one subscription per replica carries the deltas of all its
        requests there, once per step (a new client for a restarted group's new leader)."""
        client = self._clients.get(decision.group)
        if client is None or client.leader != decision.leader:
            client = self._clients[decision.group] = GroupClient(decision.group, decision.leader)
        return client

    async def generate(
        self,
        t: Tenant,
        prompt: list[int],
        params: SamplingParams,
        api: str,
        pin_tokens: int,
        pin_ttl_s: float,
        account: Account,
        restartable: bool = False,
        n: int = 1,
        cache_key: str | None = None,
    ) -> Run:
        """Route and run one request; yields (output, tokens the router expected cached). However it ends
        (finished, failed, or the client went away), ``account(last output, predicted)`` records its usage
        once, and an unfinished request is aborted on its group (by its ``GroupClient`` stream).

        A group that fails (or is silent and unhealthy, see ``_outputs``) is reported to the routers (which route
        nothing more to it) and the request is retried on another group, as long as nothing has been yielded
        yet, or at any point when ``restartable`` (the caller keeps only the last output). A request the
        engine failed alone answers 500; its group keeps serving.

        ``n`` > 1: the prompt's ``n`` choices, computed once on one group; their outputs come interleaved (each
        with its ``index``) until every choice has finished, and ``account`` gets them merged (the prompt once,
        the completion tokens of all). ``cache_key`` (OpenAI's ``prompt_cache_key``) is routed by
        (``Router.route``)."""
        failed: list[str] = []
        rid = f"{t.name}-{secrets.token_hex(8)}"  # unique across router replicas and gateways
        timing = RequestTiming(time.monotonic())  # latencies as the client sees them, retries included
        acc = current_access() if account is not no_account else None  # the access log's record of the request
        rt = current_trace()  # the request's trace (router/gateway/tracing.py), when tracing is on
        while True:
            attempt = f"{rid}-{len(failed)}"
            router: RouterClient | None = None
            decision: RouteDecision | None = None
            out: RequestOutput | None = None
            lasts: dict[int, RequestOutput] = {}  # n > 1: each choice's latest output
            finals: list[tuple[int, RequestOutput]] | None = None if rt is None else []  # (arrived, final output)
            timings: list[Timings] = []  # the engine's, of each choice's final output
            yielded = finished = False
            try:
                if rt is None:
                    router, decision = await self._route(t, prompt, attempt, failed, api, cache_key, n)
                else:
                    routed = time.time_ns()
                    try:
                        router, decision = await self._route(t, prompt, attempt, failed, api, cache_key, n)
                    except BaseException as exc:
                        rt.route_span(routed, None, self.config.block_size, len(failed), exc)
                        raise
                    rt.route_span(routed, decision, self.config.block_size, len(failed))
                req = Submit(prompt, params, t.name, attempt, pin_tokens, pin_ttl_s, n)
                left = n
                async for out in _outputs(self._client(decision), req, api):
                    if not yielded and len(out.token_ids) == len(out.new_token_ids):
                        self.reports.add(router, "prefill_done", attempt)
                    if n > 1:
                        lasts[out.index] = out
                    left -= out.finished
                    finished = left == 0
                    yielded = True
                    if out.finished:
                        if out.timings is not None:
                            timings.append(out.timings)
                        if finals is not None:
                            finals.append((time.time_ns(), out))
                    timing.tick(time.monotonic(), len(out.new_token_ids))
                    if acc is not None and out.new_token_ids:
                        acc.first_token()
                    yield out, decision.cached_tokens
                    if finished:
                        break
                return
            except GroupFailed as exc:
                assert decision is not None  # only the group's stream raises it, after routing
                for r in self.routers:  # no replica should send more requests there
                    r.report_failure(decision.group, str(exc))
                failed.append(decision.group)
                if (yielded and not restartable) or len(failed) > MAX_GROUP_RETRIES:
                    raise err(503, f"worker group {decision.group} failed during the request; retry it", api) from None
                out = None  # nothing of the failed attempt is billed: the retry starts over
            finally:
                if router is not None:
                    self.reports.add(router, "finish", attempt)  # also when the client left during routing
                if rt is not None and finals and decision is not None:  # queue, prefill, decode: the engine's timings
                    rt.group_spans(decision.group, finals)
                if out is not None and decision is not None:  # an output came from the routed group
                    _PIN_TTL.set(pin_ttl_s)  # what ``Gateway.account`` prices this request's writes at
                    account(merge_choices(list(lasts.values())) if lasts else out, decision.cached_tokens)
                if finished and account is not no_account and self.metrics_on:  # internal ones: not the tenant's
                    timing.finish(time.monotonic())
                    t.metrics.observe(timing)
                    if decision is not None and out is not None:
                        t.metrics.observe_group(
                            timings, out.num_cached_tokens, decision.host_tokens, decision.disk_tokens
                        )

    # -- accounting --------------------------------------------------------------------------------------------

    def reported_cached(self, t: Tenant, num_cached: int) -> int:
        """Implicit tenants see reuse from ``min_prefix_tokens`` up; explicit tenants see all of it."""
        c = t.config.cache
        return num_cached if c.mode == "explicit" or num_cached >= c.min_prefix_tokens else 0

    def account(
        self,
        t: Tenant,
        out: RequestOutput,
        predicted: int,
        cached: int,
        write: int = 0,
        read: int = 0,
        write_ttl_s: float | None = None,
        write_segments: list[tuple[int, float]] | None = None,
    ) -> None:
        """Record a request's usage and cost (at the tenant's prices; ``cached`` tokens are billed as cache reads,
        ``write`` ones as written to an entry living ``write_ttl_s``: by default the pin TTL of the request
        ``generate`` is accounting, else the tenant's ``default_ttl``; or, with ``write_segments``, runs of
        (tokens, TTL) that add up to ``write``) in the ledger and the tenant's metrics; a hit-rate drop this request
        reveals is logged and kept for the admin API."""
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        ttl = write_ttl_s if write_ttl_s is not None else _PIN_TTL.get() or t.config.cache.default_ttl
        cost = request_cost(t.prices, n_prompt, cached, write, n_out, ttl, write_segments)
        self.ledger.record(
            t.name,
            requests=1,
            prompt_tokens=n_prompt,
            cached_tokens=cached,
            output_tokens=n_out,
            cache_write_tokens=write,
            cache_read_tokens=read,
            **cost.ledger_fields(),
        )
        alert = None
        if self.metrics_on:
            alert = t.metrics.record(
                n_prompt, cached, n_out, predicted, out.num_cached_tokens, out.prompt_token_ids, cost, write
            )
        acc = current_access()
        if acc is not None:
            acc.usage(n_prompt, cached, n_out)
        if alert is not None:
            log.warning("%s", alert.message())
            self.spawn(self.alerts.push(alert.public()))

    async def repin(self, t: Tenant, tokens: list[int], ttl_s: float) -> None:
        """Pin ``tokens`` on a group for ``ttl_s`` more by the request a hit on them sends (one output token, not
        billed): the keep-alive service's re-pin of an entry it kept."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        await last(self.generate(t, tokens, params, "anthropic", len(tokens), ttl_s, no_account))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run a best-effort Redis write in the background (its failure is logged, never the request's)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    @staticmethod
    async def settle(tasks: list[asyncio.Task]) -> None:
        """Wait (at most ``SETTLE_S``) for the writes a request started, before its response ends: the next
        request, to any replica, then sees them. A write that fails or is slow (Redis down) is not the
        request's failure; it was logged and goes on in the background."""
        if tasks:
            await asyncio.wait(tasks, timeout=SETTLE_S)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("gateway background write failed: %s", task.exception())

    # -- documentation (``http.docs``) and a tenant's metrics --------------------------------------------------

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

    @routes.get("/{tenant}/metrics")
    async def metrics(self, tenant: str, request: Request):
        """This tenant's own counters only: worker-group load moves with every tenant's traffic, so it is on the
        admin API (``/admin/v1/metrics``), never here. Every gateway replica's samples, merged (whichever replica
        answers: router/gateway/replica_metrics.py); 503 while Redis is unavailable."""
        t = self.auth(tenant, request, "openai")
        if not self.metrics_on:
            raise err(404, "metrics are off on this server (metrics: {enabled: false} in its config)", "openai")
        return Response(await self.replica_metrics.exposition(t.name), media_type=CONTENT_TYPE_LATEST)
