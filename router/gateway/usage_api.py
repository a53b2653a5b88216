"""A tenant's prompt-cache economics over HTTP, and the operator's view of every tenant's.

    GET /{tenant}/v1/usage          (tenant key) counters, cost, cost without the cache, savings
    GET /{tenant}/v1/cache/advice   (tenant key) the cache advisor over the tenant's sampled prompts
    GET /admin/v1/usage             (admin key) every tenant's /v1/usage
    GET /admin/v1/alerts            (admin key) recent hit-rate drop alerts (``?tenant=`` for one)

and the ledger's per-tenant counters added to ``GET /admin/v1/metrics`` (``admin_metrics``). The tenant's cost
comes from the usage ledger in Redis (every gateway replica's traffic, router/gateway/store.py ``UsageLedger``),
priced per request at the tenant's prices (router/gateway/economics.py)."""

# No "from __future__ import annotations": FastAPI must see real types.

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from router.gateway import advisor, keep_alive
from router.gateway.accounting import adapter_scope
from router.gateway.core import Gateway
from router.gateway.economics import Prices, dollars, summary
from router.gateway.errors import err
from router.gateway.routes import Routes
from router.gateway.store import StoreUnavailable, presented_key
from router.gateway.tenants import Tenant

API = "openai"
routes = Routes()  # bound to one UsageApi by create_app


class UsageApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def usage_of(self, t: Tenant) -> dict:
        out = summary(t.name, t.prices, await self.gw.ledger.totals(t.name))
        state = await self.gw.budgets.state(t.name)  # its budget this period (router/gateway/budgets.py)
        out["budget"] = None if state is None else state.public()
        if t.adapters:  # each adapter's part of the totals above
            out["adapters"] = {
                name: summary(t.name, t.prices, await self.gw.ledger.totals(adapter_scope(t.name, name)))
                for name in sorted(t.adapters)
            }
        return out

    @routes.get("/{tenant}/v1/usage")
    async def usage(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        out = await self.usage_of(t)
        key = request.state.key  # a key made by the admin API may have a budget of its own
        scope = self.gw.budgets.key_budget(t.name, key)
        if scope is not None:
            state = await self.gw.budgets.state(scope)
            out["key_budget"] = None if state is None else {"key_id": key.id, **state.public()}
        return out

    @routes.get("/{tenant}/v1/cache/advice")
    async def advice(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        sample = t.config.advice.sample
        if not sample:
            raise err(
                404,
                "the cache advisor is off for this tenant; enable it with advice: {sample: N} in its config",
                API,
            )
        rows = await self.gw.samples.recent(t.name)
        report = await self.gw.prompts.compute(
            t, self._advise, t, rows
        )  # seconds for a large sample: off the event loop
        return {"tenant": t.name, "sampled": len(rows), "sample_limit": sample, **report}

    def _advise(self, t: Tenant, rows: list[dict]) -> dict:
        explicit = t.config.cache.mode == "explicit"
        return advisor.advise(
            [advisor.view_of_sample(row, self.gw.prompts.thread_tokenizer()) for row in rows],
            block_size=self.gw.config.block_size,
            prices=t.prices,
            explicit=explicit,
            min_prefix_tokens=1 if explicit else t.config.cache.min_prefix_tokens,
        )

    # -- the admin view ------------------------------------------------------------------------------------

    def _admin(self, request: Request) -> None:
        if not self.gw.keys.authenticate("admin", presented_key(request.headers)):
            raise _Denied()

    async def admin_usage(self, request: Request):
        self._admin(request)
        return {"tenants": [await self.usage_of(t) for t in self.gw.tenants.values()]}

    async def admin_alerts(self, request: Request, tenant: str | None = None):
        self._admin(request)
        return {"alerts": await self.gw.alerts.recent(tenant)}

    async def admin_metrics(self) -> bytes:
        """Every tenant's ledger counters (all replicas' traffic, from Redis) in Prometheus's text format."""
        registry = CollectorRegistry()
        registry.register(_LedgerCollector(await self._all_totals()))
        return generate_latest(registry)

    async def _all_totals(self) -> list[tuple[str, Prices, dict[str, int]]]:
        out = []
        for t in self.gw.tenants.values():
            try:
                out.append((t.name, t.prices, await self.gw.ledger.totals(t.name)))
            except StoreUnavailable:  # Redis down: no ledger series this scrape, the group gauges still show
                return []
        return out


class _Denied(Exception):
    pass


async def _denied(_: Request, __: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": "invalid admin key", "code": 401}}, status_code=401)


async def _store_down(_: Request, __: Exception) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": "the service's state store is unavailable; retry shortly", "code": 503}},
        status_code=503,
        headers={"Retry-After": "2"},
    )


_LEDGER_SERIES = [  # (metric, help, ledger field or a money field)
    ("kvgrid_tenant_requests", "Requests (ledger, every replica)", "requests"),
    ("kvgrid_tenant_prompt_tokens", "Prompt tokens (ledger)", "prompt_tokens"),
    ("kvgrid_tenant_cached_tokens", "Prompt tokens served from the cache (ledger)", "cached_tokens"),
    ("kvgrid_tenant_output_tokens", "Output tokens (ledger)", "output_tokens"),
    ("kvgrid_tenant_cache_write_tokens", "Prompt tokens written to explicit entries (ledger)", "cache_write_tokens"),
    ("kvgrid_tenant_cost_dollars", "Cost at the tenant's prices (ledger)", "cost_pusd"),
    ("kvgrid_tenant_cost_without_cache_dollars", "Cost without the cache (ledger)", "uncached_cost_pusd"),
]


class _LedgerCollector:
    def __init__(self, rows: list[tuple[str, Prices, dict[str, int]]]) -> None:
        self.rows = rows

    def collect(self):
        for name, doc, field in _LEDGER_SERIES:
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for tenant, _, totals in self.rows:
                value = totals.get(field, 0)
                family.add_metric([tenant], dollars(value) if field.endswith("_pusd") else value)
            yield family


def mount_admin(admin: FastAPI, api: UsageApi) -> None:
    """The admin API's usage and alert routes, and the ledger series on its metrics (``admin.state.admin``)."""
    admin.add_exception_handler(_Denied, _denied)
    admin.add_exception_handler(StoreUnavailable, _store_down)
    admin.add_api_route("/v1/usage", api.admin_usage, methods=["GET"])
    admin.add_api_route("/v1/alerts", api.admin_alerts, methods=["GET"])
    owner = getattr(admin.state, "admin", None)
    if owner is not None:
        owner.extra_metrics.append(api.admin_metrics)
        # every tenant's keep-alive decisions
        owner.extra_metrics.append(keep_alive.AdminSeries(api.gw.tenants, api.gw.keep_alive.store))
