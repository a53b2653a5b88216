"""One gateway replica (``Gateway``): the parts every API's handlers use, built once and wired together.

    admission    router/gateway/admission.py   the tenant's key, body, limits, in-flight places, model, context
    prompts      router/gateway/prompts.py     chat templates and tokenizing (off the event loop), parameters
    generation   router/gateway/generation.py  routing (router/gateway/router_pool.py, hedged), the group's
                                               stream, retries on another group, one ``GenerateRequest`` each
    accounting   router/gateway/accounting.py  usage and cost in the ledger and metrics; background writes

A handler (router/gateway/{openai,anthropic,gemini}/) calls them in that order. Each tenant's state is a ``Tenant``
(router/gateway/tenants.py). The tenant's own metrics endpoint and the docs are here too; router/gateway/app.py
builds the ASGI app from it all."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

import asyncio
import gc
import logging
from collections.abc import Sequence
from functools import partial

from fastapi import Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from common.config import ServeConfig, TenantConfig
from common.model_config import ModelConfig, max_model_len
from common.sampling import SamplingParams
from router.clients import RouterClient
from router.gateway.accounting import Accounting
from router.gateway.admission import Admission
from router.gateway.budgets import BudgetGate
from router.gateway.errors import err
from router.gateway.generation import GenerateRequest, Generation
from router.gateway.keep_alive import KeepAlive
from router.gateway.prompts import Prompts
from router.gateway.replica_metrics import ReplicaMetrics, Source, tenant_extras
from router.gateway.router_pool import RouterPool
from router.gateway.routes import Routes
from router.gateway.runs import last
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
)
from router.gateway.tenant_registry import LiveKeys
from router.gateway.tenant_sync import TenantSync
from router.gateway.tenants import Tenant
from router.gateway.tracing import Tracing

log = logging.getLogger(__name__)

routes = Routes()  # the shared endpoints (docs, a tenant's metrics), bound to one Gateway by create_app


class Gateway:
    """One gateway replica's state and parts (``config`` has no API keys, ``keys`` their hashes). ``routers``: the
    RouterService replicas' clients; a request stays with the replica that routed it (the others are told of it
    unless ``routing.share_routes`` is off)."""

    def __init__(
        self, config: ServeConfig, keys: KeyRing, model_path: str, routers: Sequence[RouterClient], redis_url: str
    ) -> None:
        self.config = config
        self.model_id = config.model_id
        # Tenants' keys as the tenant registry holds them (router/gateway/tenant_registry.py), the config's until read.
        self.keys = keys = LiveKeys(keys)
        # The same limit the engine enforces.
        self.max_model_len = max_model_len(ModelConfig.from_folder(model_path), config.max_model_len)
        self.redis = connect(redis_url, config.redis_timeout_s)
        self.ledger = UsageLedger(self.redis)
        self.alerts = AlertLog(self.redis)
        self.samples = PromptSamples(self.redis)
        self.entries = EntryStore(self.redis)
        self.metrics_on = config.metrics.enabled  # off: no metric updates per request, no publishing
        self.accounting = Accounting(self.ledger, self.alerts, self.metrics_on)
        # Each tenant's state (``put_tenant``): the config's tenants now, the tenant registry's as they change.
        self.tenants: dict[str, Tenant] = {}
        self.contents: dict[str, CachedContentStore] = {}
        self.admission = Admission(
            self.tenants, keys, self.model_id, self.max_model_len, {}, self.samples, self.accounting.spawn
        )
        # Tenants' spending budgets, reserved at admission and settled when a request ends (router/gateway/budgets.py).
        self.budgets = BudgetGate(self.redis)
        self.budgets.spawn, self.budgets.on_spent = self.accounting.spawn, self._budget_metrics
        self.admission.budgets = self.budgets
        self.admission.redis = self.redis  # the API keys' own rate limiters
        self.prompts = Prompts(model_path, self.max_model_len, self.contents)
        self.pool = RouterPool([RouterClient.of(r) for r in routers], config.routing.share_routes)
        self.generation = Generation(self.pool, config.block_size, self.metrics_on)
        # keep_alive: auto tenants' entries (router/gateway/keep_alive.py)
        self.keep_alive = KeepAlive(self.redis, {}, self.accounting.spawn, self.ledger, self.repin)
        # Each tenant's metrics published to Redis every second and merged over the replicas at a scrape
        # (router/gateway/replica_metrics.py).
        self.replica_metrics = ReplicaMetrics(self.redis, {})
        for t in config.tenants:
            self.put_tenant(t)
        self.keep_alive.start()
        if self.metrics_on:
            self.replica_metrics.start()
        # Tenants created, changed or deleted at run time, by any replica (router/gateway/tenant_sync.py).
        self.tenant_sync = TenantSync(self, keys)
        self.tenant_sync.start()
        # OpenTelemetry traces of the requests (router/gateway/tracing.py): None without ``tracing`` in the config.
        self.tracing = Tracing.start(config.tracing)
        # What exists now (modules, tokenizer, the app) lives as long as the process: out of the collector's full
        # passes, whose pause would stall the event loop for every request (the longer, the bigger the heap).
        gc.freeze()

    async def close(self) -> None:
        """When the replica stops, on the loop that served it: let the background writes started by finished
        requests (cache entries, deletes) end, write the usage still buffered (Redis permitting), close Redis."""
        await self.tenant_sync.close()
        await self.keep_alive.close()
        self.prompts.close()
        self.pool.reports.flush()
        await self.accounting.close()
        try:
            await self.ledger.close()
        except StoreUnavailable:
            log.warning("usage not yet written to Redis was lost at shutdown")
        if self.metrics_on:
            await self.replica_metrics.close()  # its last samples; its counters stay in the totals
        await self.redis.aclose()
        if self.tracing is not None:  # the spans still buffered go out (a collector that is gone: SHUTDOWN_S)
            await asyncio.to_thread(self.tracing.shutdown)

    def put_tenant(self, cfg: TenantConfig) -> Tenant:
        """This replica's state of a tenant, from ``cfg``: at start, and whenever the tenant registry adds or changes
        one (router/gateway/tenant_sync.py). An existing tenant is updated in place, so its metrics and in-flight
        count carry on; its rate limiters, cached-content store and keep-alive follow the new config."""
        lim = cfg.limits
        limiter = RateLimiter(self.redis, lim.requests_per_s, lim.tokens_per_min)
        t = self.tenants.get(cfg.name)
        if t is None:
            c = self.config
            t = Tenant(cfg, limiter, c.block_size, c.monitoring, self.model_id, c.lora.max_lora_rank)
            self.tenants[cfg.name] = t
        else:
            t.update(cfg, limiter)
        self.contents[cfg.name] = CachedContentStore(self.redis, lim.max_cached_contents, lim.max_cached_content_tokens)
        # The same request counters without the token ones: what a request that generates nothing (count_tokens)
        # counts against.
        self.admission.request_rates[cfg.name] = RateLimiter(self.redis, lim.requests_per_s, None)
        self.budgets.set_budget(cfg.name, cfg.budget)
        self.keep_alive.set_tenant(t)  # its keep-alive series join the tenant's registry before it is published
        if cfg.name not in self.replica_metrics.sources:
            self.replica_metrics.sources[cfg.name] = Source(t.metrics.registry, partial(tenant_extras, t.metrics))
        return t

    def drop_tenant(self, name: str) -> None:
        """Forget a deleted tenant: its new requests get 401; those in flight finish."""
        self.tenants.pop(name, None)
        self.contents.pop(name, None)
        self.admission.request_rates.pop(name, None)
        self.budgets.set_budget(name, None)
        self.replica_metrics.sources.pop(name, None)
        self.keep_alive.drop_tenant(name)

    def _budget_metrics(self, scope: str, spent: float, soft_exceeded: bool) -> None:
        t = self.tenants.get(scope)
        if t is not None and self.metrics_on:
            t.metrics.budget(spent, soft_exceeded)

    async def repin(self, t: Tenant, tokens: list[int], ttl_s: float) -> None:
        """Pin ``tokens`` on a group for ``ttl_s`` more by the request a hit on them sends (one output token, not
        billed): the keep-alive service's re-pin of an entry it kept."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        await last(self.generation.generate(GenerateRequest(t, tokens, params, "anthropic", len(tokens), ttl_s)))

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
        t = self.admission.auth(tenant, request, "openai")
        if not self.metrics_on:
            raise err(404, "metrics are off on this server (metrics: {enabled: false} in its config)", "openai")
        return Response(await self.replica_metrics.exposition(t.name), media_type=CONTENT_TYPE_LATEST)
