"""One tenant's state in a gateway replica (``Tenant``: its config, rate limiter, metrics, prices and in-flight
count) and the in-flight places its requests hold (``Slot``; ``SlotStream`` keeps one until its stream ends)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from common.config import MonitoringConfig, TenantConfig
from router.gateway.economics import Prices
from router.gateway.store import RateLimiter
from router.gateway.tenant_metrics import TenantMetrics


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
        self.metrics = TenantMetrics(config.name, block_size, monitoring, model_name)
        self.prices = Prices.from_config(config.prices)
        self.inflight = 0

    def update(self, config: TenantConfig, limiter: RateLimiter) -> None:
        """A changed config (the tenant registry's): its limits and prices from now on; metrics and in-flight
        requests carry on."""
        self.config, self.limiter, self.prices = config, limiter, Prices.from_config(config.prices)


class Slot:
    """One of a tenant's in-flight places in this replica, held by one request from admission to its end and
    released exactly once. It carries what ends with the request: ``cost``, what the request has cost so far
    (pico-dollars, added by accounting), and ``on_release``, run once when it is released (a budget's
    settlement at that cost)."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant, self.held = tenant, True
        self.cost = 0
        self.on_release: list[Callable[[Slot], None]] = []
        tenant.inflight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.tenant.inflight -= 1
            for f in self.on_release:
                f(self)


class SlotStream(StreamingResponse):
    """A streamed answer (server-sent events) that holds its request's in-flight slot until the stream ends,
    however it ends."""

    slot: Slot | None = None

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.slot is not None:
                self.slot.release()
