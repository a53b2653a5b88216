"""One tenant's state in a gateway replica (``Tenant``: its config, rate limiter, metrics, prices and in-flight
count) and the in-flight places its requests hold (``Slot``; ``SlotStream`` keeps one until its stream ends)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from common.config import MonitoringConfig, TenantConfig
from common.lora import AdapterError, AdapterRef, AdapterSpec, read_adapter
from router.gateway.economics import Prices
from router.gateway.store import RateLimiter
from router.gateway.tenant_metrics import TenantMetrics
from router.gateway.tenant_registry import KeyRecord

log = logging.getLogger(__name__)

_SPECS: dict[tuple[str, int, int, int], AdapterSpec] = {}  # (path, mtime, size, max rank) -> its checked spec


def adapter_refs(config: TenantConfig, max_rank: int) -> dict[str, AdapterRef]:
    """The tenant's LoRA adapters by name, each checked (``read_adapter``) and named by its id. The config was
    checked when it was loaded; a folder that went bad since is left out (logged), and requests naming it get 404.
    A folder is read and digested once while its weights file is unchanged."""
    refs = {}
    for name, path in config.adapters.items():
        try:
            st = os.stat(os.path.join(path, "adapter_model.safetensors"))
            key = (path, st.st_mtime_ns, st.st_size, max_rank)
            spec = _SPECS.get(key)
            if spec is None:
                spec = _SPECS[key] = read_adapter(path, max_rank)
        except (AdapterError, OSError) as exc:
            log.error("tenant %s: adapter %s left out: %s", config.name, name, exc)
            continue
        refs[name] = AdapterRef(spec.id, spec.path)
    return refs


class Tenant:
    """One tenant's state in this replica: its config, rate limiter, metrics, in-flight count and adapters."""

    def __init__(
        self,
        config: TenantConfig,
        limiter: RateLimiter,
        block_size: int = 16,
        monitoring: MonitoringConfig | None = None,
        model_name: str = "",
        max_lora_rank: int = 64,
    ) -> None:
        self.name, self.config = config.name, config
        self.max_lora_rank = max_lora_rank
        self.adapters = adapter_refs(config, max_lora_rank)
        self.limiter = limiter
        self.metrics = TenantMetrics(config.name, block_size, monitoring, model_name)
        self.prices = Prices.from_config(config.prices)
        self.inflight = 0

    def update(self, config: TenantConfig, limiter: RateLimiter) -> None:
        """A changed config (the tenant registry's): its limits and prices from now on; metrics and in-flight
        requests carry on."""
        self.config, self.limiter, self.prices = config, limiter, Prices.from_config(config.prices)
        self.adapters = adapter_refs(config, self.max_lora_rank)


def key_scope(tenant: str, key_id: str) -> str:
    """The rate limiter's and budget's scope of one API key of ``tenant`` (no tenant name holds a '/')."""
    return f"{tenant}/{key_id}"


class Slot:
    """One of a tenant's in-flight places in this replica, held by one request from admission to its end and
    released exactly once. It carries what ends with the request: ``cost``, what the request has cost so far
    (pico-dollars, added by accounting), and ``on_release``, run once when it is released (a budget's
    settlement at that cost)."""

    def __init__(self, tenant: Tenant, key: KeyRecord | None = None) -> None:
        self.tenant, self.held = tenant, True
        self.key = key  # the stored record of the key it came with (its own limits and budget); None: a config key
        self.cost = 0
        self.adapter: tuple[str, AdapterRef] | None = None  # (name, ref) of the LoRA adapter it runs under
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
