"""What a request costs and what it leaves behind (``Accounting``): usage and cost at the tenant's prices in the
ledger and the tenant's metrics, a hit-rate drop it reveals, and the best-effort Redis writes a request starts in
the background (``spawn``; ``settle`` waits briefly for a request's own before its response ends)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from common.outputs import RequestOutput
from router.gateway.access import current as current_access
from router.gateway.economics import request_cost
from router.gateway.store import AlertLog, UsageLedger
from router.gateway.tenants import Slot, Tenant

log = logging.getLogger(__name__)

SETTLE_S = 1.0  # a response waits this long for the cache-entry writes of its request
CLOSE_BACKGROUND_S = 2.0  # a stopping replica waits this long for its background Redis writes


def adapter_scope(tenant: str, adapter: str) -> str:
    """The usage ledger's scope of a tenant's adapter (a tenant name holds no ':', so it is no tenant's)."""
    return f"{tenant}:adapter:{adapter}"


class Accounting:
    """One replica's usage records: ``ledger`` (Redis, buffered), ``alerts`` (hit-rate drops, for the admin API),
    per-tenant metrics when ``metrics_on``, and its background writes."""

    def __init__(self, ledger: UsageLedger, alerts: AlertLog, metrics_on: bool) -> None:
        self.ledger, self.alerts, self.metrics_on = ledger, alerts, metrics_on
        self._background: set[asyncio.Task] = set()

    async def close(self) -> None:
        """Let the background writes started by finished requests (cache entries, deletes) end."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=CLOSE_BACKGROUND_S)

    def reported_cached(self, t: Tenant, num_cached: int) -> int:
        """Implicit tenants see reuse from ``min_prefix_tokens`` up; explicit tenants see all of it."""
        c = t.config.cache
        return num_cached if c.mode == "explicit" or num_cached >= c.min_prefix_tokens else 0

    def account(
        self,
        slot: Slot,
        out: RequestOutput,
        predicted: int,
        cached: int,
        write: int = 0,
        read: int = 0,
        write_ttl_s: float | None = None,
        write_segments: list[tuple[int, float]] | None = None,
    ) -> None:
        """Record a request's usage and cost at the tenant's prices in the ledger and the tenant's metrics:
        ``cached`` tokens billed as cache reads, ``write`` ones as written to an entry living ``write_ttl_s`` (the
        request's pin TTL; by default the tenant's ``default_ttl``), or, with ``write_segments``, in runs of
        (tokens, TTL) that add up to ``write``. A hit-rate drop this request reveals is logged and kept for the
        admin API. The cost is added to ``slot``'s, at which its budget is settled when the request ends."""
        t = slot.tenant
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        ttl = write_ttl_s if write_ttl_s is not None else t.config.cache.default_ttl
        cost = request_cost(t.prices, n_prompt, cached, write, n_out, ttl, write_segments)
        slot.cost += cost.cost
        counts = dict(
            requests=1,
            prompt_tokens=n_prompt,
            cached_tokens=cached,
            output_tokens=n_out,
            cache_write_tokens=write,
            cache_read_tokens=read,
            **cost.ledger_fields(),
        )
        self.ledger.record(t.name, **counts)
        if slot.adapter is not None:  # the adapter's own line too (/v1/usage's adapters)
            self.ledger.record(adapter_scope(t.name, slot.adapter[0]), **counts)
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
