"""Each gateway replica's copy of the tenant registry (router/gateway/tenant_registry.py): ``TenantSync`` seeds the
config's tenants at start, then checks the registry's version every ``interval_s`` and, when it moved, rebuilds the
replica's state of the tenants whose config changed (only those) and swaps in every tenant's keys.

A tenant's state (router/gateway/tenants.py ``Tenant``) is updated in place when its config changes, so its metrics
and in-flight count carry on; a new tenant gets its state built as at start; a deleted one is dropped (its requests
in flight finish; new ones get 401). ``listeners`` are told of every change (name, the new config or None), for
more per-tenant state kept elsewhere (a budget, say)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from common.config import TenantConfig
from router.gateway.cached_content_store import CachedContentStore
from router.gateway.economics import Prices
from router.gateway.keep_alive import _TenantCounters
from router.gateway.replica_metrics import Source, tenant_extras
from router.gateway.store import RateLimiter, StoreUnavailable
from router.gateway.tenant_registry import LiveKeys, TenantRegistry, stored_config, tenant_config
from router.gateway.tenants import Tenant


class Gateway(Protocol):
    """What of router/gateway/core.py's Gateway a tenant's state lives in (a Protocol: core imports this module)."""

    config: Any
    redis: Any
    tenants: dict[str, Tenant]
    contents: dict[str, CachedContentStore]
    admission: Any
    replica_metrics: Any
    keep_alive: Any


log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 0.25  # a change reaches every replica within about this (plus one read)
SEED_RETRY_S = 1.0
CLOSE_S = 2.0


class TenantSync:
    def __init__(self, gw: Gateway, keys: LiveKeys, interval_s: float = SYNC_INTERVAL_S) -> None:
        self.gw, self.keys, self.interval_s = gw, keys, interval_s
        self.registry = TenantRegistry(gw.redis)
        self.version: int | None = None
        # What this replica's state was built from: each tenant's stored config, as canonical JSON.
        self.built = {t.name: _canon(stored_config(t)) for t in gw.config.tenants}
        self.listeners: list[Callable[[str, TenantConfig | None], None]] = []
        self.seeded = False
        self._task: asyncio.Task | None = None
        self._closed = False
        self._lock: asyncio.Lock | None = None

    def start(self) -> None:
        """Start the background task in the running event loop (idempotent; a no-op without a loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._closed or (self._task is not None and not self._task.done() and self._task.get_loop() is loop):
            return
        self._lock = asyncio.Lock()
        self._task = loop.create_task(self._run(), name="kvgrid-tenant-sync")

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Bounded: a cancel that lands as a Redis timeout expires is taken for that timeout; the loop then
            # ends at its next check of ``_closed``.
            await asyncio.wait({task}, timeout=CLOSE_S)

    async def _run(self) -> None:
        failing = False
        while not self._closed:
            try:
                if not self.seeded:
                    await self.seed()
                await self.refresh()
                if failing:
                    log.info("the tenant registry in Redis is reachable again")
                failing = False
            except StoreUnavailable as exc:
                if not failing:
                    log.warning("cannot read the tenant registry (%s); serving the tenants as last read", exc)
                failing = True
            except Exception:  # a bug must not end the sync for good
                log.exception("tenant registry sync failed")
            await asyncio.sleep(self.interval_s if self.seeded else SEED_RETRY_S)

    async def seed(self) -> None:
        base = self.keys.base
        await self.registry.seed(self.gw.config.tenants, {t.name: base.hashes(t.name) for t in self.gw.config.tenants})
        self.seeded = True

    async def refresh(self, force: bool = False) -> None:
        """Read the registry if its version moved (or ``force``) and apply what changed."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not force and self.version is not None and await self.registry.version() == self.version:
                return
            snap = await self.registry.snapshot()
            if snap.version == 0 and not snap.configs:
                # Redis lost its data (or was never seeded): keep serving as last read, and seed again.
                self.seeded = False
                return
            for name in set(self.built) - set(snap.configs):
                self.apply(name, None)
            for name, text in snap.configs.items():
                if self.built.get(name) != text:
                    self.apply(name, tenant_config(json.loads(text)))
            self.keys.live = snap.keys
            self.version = snap.version

    def apply(self, name: str, cfg: TenantConfig | None) -> None:
        """Rebuild this replica's state of one tenant from ``cfg`` (None: the tenant is gone)."""
        apply_tenant(self.gw, name, cfg)
        if cfg is None:
            self.built.pop(name, None)
        else:
            self.built[name] = _canon(stored_config(cfg))
        for listener in self.listeners:
            try:
                listener(name, cfg)
            except Exception:
                log.exception("a tenant change listener failed for %s", name)


def _canon(stored: dict) -> str:
    return json.dumps(stored, sort_keys=True)


def apply_tenant(gw: Gateway, name: str, cfg: TenantConfig | None) -> None:
    """The gateway's per-tenant state for ``cfg``: the Tenant (updated in place when it exists), its rate limiters,
    cached-content store, keep-alive and published metrics."""
    ka = gw.keep_alive
    if cfg is None:
        gw.tenants.pop(name, None)
        gw.contents.pop(name, None)
        gw.admission._request_rates.pop(name, None)
        gw.replica_metrics.sources.pop(name, None)
        ka.auto.pop(name, None)
        ka.counters.pop(name, None)
        return
    lim = cfg.limits
    limiter = RateLimiter(gw.redis, lim.requests_per_s, lim.tokens_per_min)
    t = gw.tenants.get(name)
    if t is None:
        t = Tenant(cfg, limiter, gw.config.block_size, gw.config.monitoring, gw.config.model_id)
        ka.counters[name] = _TenantCounters(t)
        gw.replica_metrics.sources[name] = Source(t.metrics.registry, partial(tenant_extras, t.metrics))
        gw.tenants[name] = t
    else:
        t.config, t.limiter, t.prices = cfg, limiter, Prices.from_config(cfg.prices)
    gw.contents[name] = CachedContentStore(gw.redis, lim.max_cached_contents, lim.max_cached_content_tokens)
    gw.admission._request_rates[name] = RateLimiter(gw.redis, lim.requests_per_s, None)
    if cfg.keep_alive == "auto":
        ka.auto[name] = t
        ka.start()
    else:
        ka.auto.pop(name, None)
