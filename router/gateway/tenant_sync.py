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
from typing import Any, Protocol

from common.config import TenantConfig
from router.gateway.store import StoreUnavailable
from router.gateway.tenant_registry import LiveKeys, TenantRegistry, stored_config, tenant_config


class Gateway(Protocol):
    """What of router/gateway/core.py's Gateway the sync uses (a Protocol: core imports this module)."""

    config: Any
    redis: Any

    def put_tenant(self, cfg: TenantConfig) -> Any: ...

    def drop_tenant(self, name: str) -> None: ...


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
        if cfg is None:
            self.gw.drop_tenant(name)
            self.built.pop(name, None)
        else:
            self.gw.put_tenant(cfg)
            self.built[name] = _canon(stored_config(cfg))
        for listener in self.listeners:
            try:
                listener(name, cfg)
            except Exception:
                log.exception("a tenant change listener failed for %s", name)


def _canon(stored: dict) -> str:
    return json.dumps(stored, sort_keys=True)
