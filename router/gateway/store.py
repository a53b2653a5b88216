"""State the gateways share through Redis: the usage ledger, cached content objects, explicit cache entries and
rate-limit counters. Every key is namespaced by tenant, so one tenant's ids mean nothing under another's.

Redis is never in the way of a request for long: the request-path methods are async (``redis.asyncio``), each
one is bounded by twice the client's timeout (``connect``), and every Redis failure or timeout surfaces as
``StoreUnavailable`` (the gateway answers 503 with Retry-After). API keys are checked in memory (``KeyRing``),
and usage is buffered in the process (``UsageLedger``), so neither depends on Redis being up."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import TypeVar

import redis
import redis.asyncio
import xxhash

from common.config import ServeConfig
from common.hashing import token_bytes
from router.gateway.cached_content_store import CachedContent, CachedContentStore, rfc3339
from router.gateway.store_base import (
    LimitExceeded,
    StoreUnavailable,
    _Backed,
    _bounded,
    _ms,
    _timeout_of,
    connect,
    with_password,
)
from router.gateway.usage_store import USAGE_FIELDS, UsageLedger, read_usage

__all__ = [
    "USAGE_FIELDS",
    "AlertLog",
    "CachedContent",
    "CachedContentStore",
    "EntryStore",
    "KeyRing",
    "LimitExceeded",
    "PromptSamples",
    "RateLimiter",
    "StoreUnavailable",
    "UsageLedger",
    "_Backed",
    "_bounded",
    "_timeout_of",
    "connect",
    "hash_api_key",
    "presented_key",
    "read_usage",
    "rfc3339",
    "with_password",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


def hash_api_key(key: str) -> str:
    """What is kept instead of a key: its SHA-256 (keys are long random strings, so no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


_NO_KEY = hash_api_key(secrets.token_hex(32))  # matches no key anybody knows


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request presents, in the headers the SDKs use: ``x-api-key`` (Anthropic),
    ``x-goog-api-key`` (Gemini), else ``Authorization: Bearer`` (OpenAI). The gateway and the admin API both
    read it here, so a key is found the same way everywhere."""
    key = headers.get("x-api-key") or headers.get("x-goog-api-key")
    auth = headers.get("authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return key or None


class KeyRing:
    """Tenants' API keys, checked in memory: only their SHA-256 is held, so authentication needs no Redis and
    a Redis that lost its data cannot lock anyone out."""

    def __init__(self, keys: Mapping[str, Iterable[str]]) -> None:
        self._hashes = {owner: [hash_api_key(k) for k in ks] for owner, ks in keys.items()}

    @classmethod
    def from_config(cls, config: ServeConfig) -> KeyRing:
        """Every tenant's keys, and the admin keys under the name ``admin`` (a reserved tenant name)."""
        keys = {t.name: t.api_keys for t in config.tenants}
        if config.admin_keys:
            keys["admin"] = config.admin_keys
        return cls(keys)

    def hashes(self, owner: str) -> list[str]:
        """``owner``'s key hashes (the tenant registry seeds the config's keys from them)."""
        return list(self._hashes.get(owner, ()))

    def authenticate(self, tenant: str, key: str | None) -> bool:
        """Whether ``key`` is one of ``tenant``'s keys; compares with every one of its keys in constant time."""
        if not key:
            return False
        presented = hash_api_key(key)
        ok = False
        # An unknown tenant costs a comparison too, so timing does not tell which tenants exist.
        for h in self._hashes.get(tenant) or [_NO_KEY]:
            ok |= hmac.compare_digest(h, presented)
        return ok


class AlertLog(_Backed):
    """The hit-rate drop alerts of every gateway replica (``kvgrid:alerts``, newest first, the last ``keep``), for
    the admin API. An alert names a tenant and a block position, never prompt content."""

    KEY = "kvgrid:alerts"

    def __init__(self, client: redis.asyncio.Redis, keep: int = 200) -> None:
        super().__init__(client)
        self.keep = keep

    async def push(self, alert: dict) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.lpush(self.KEY, json.dumps(alert))
            pipe.ltrim(self.KEY, 0, self.keep - 1)
            await self._do(pipe.execute())

    async def recent(self, tenant: str | None = None, limit: int = 100) -> list[dict]:
        rows = [json.loads(r) for r in await self._do(self.r.lrange(self.KEY, 0, self.keep - 1))]
        return [a for a in rows if tenant is None or a.get("tenant") == tenant][:limit]


class PromptSamples(_Backed):
    """A tenant's opt-in sample of its recent prompts for the cache advisor (``advice: {sample: N}``): a Redis list
    under the tenant's own key (``kvgrid:advice:{tenant}``), the newest ``keep`` entries, expiring ``ttl_s`` after
    the last one. Only the tenant's own key reads it (GET /{tenant}/v1/cache/advice)."""

    @staticmethod
    def key(tenant: str) -> str:
        return f"kvgrid:advice:{tenant}"

    async def add(self, tenant: str, sample: dict, keep: int, ttl_s: float) -> None:
        key = self.key(tenant)
        try:
            body = json.dumps(sample, separators=(",", ":"))
        except (TypeError, ValueError):  # not plain JSON (a caller's object): not sampled
            return
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.lpush(key, body)
            pipe.ltrim(key, 0, keep - 1)
            pipe.pexpire(key, _ms(ttl_s))
            await self._do(pipe.execute())

    async def recent(self, tenant: str) -> list[dict]:
        """The tenant's sampled prompts, oldest first."""
        rows = await self._do(self.r.lrange(self.key(tenant), 0, -1))
        return [json.loads(r) for r in reversed(rows)]


_KEEP_ENTRY = """
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], 1, 'PX', ARGV[1])
end
"""


class EntryStore(_Backed):
    """Explicit (``cache_control``) cache entries: one Redis key per tenant and marked prefix, living as long as
    the longest TTL asked for it."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        super().__init__(client)
        self._keep = client.register_script(_KEEP_ENTRY)

    @staticmethod
    def entry_key(tenant: str, tokens: list[int]) -> str:
        """The entry's Redis key for the prefix ``tokens`` of ``tenant``."""
        return f"kvgrid:pin:{tenant}:{xxhash.xxh3_128_hexdigest(token_bytes(tokens))}"

    @staticmethod
    def _check(tenant: str, entry_key: str) -> None:
        if not entry_key.startswith(f"kvgrid:pin:{tenant}:"):
            raise ValueError(f"{entry_key!r} is not an entry of tenant {tenant!r}")

    async def ttl_left(self, tenant: str, entry_key: str) -> float | None:
        """Seconds the entry still lives, or None if there is none."""
        self._check(tenant, entry_key)
        pttl = await self._do(self.r.pttl(entry_key))
        if pttl == -2:
            return None
        return float("inf") if pttl == -1 else pttl / 1000

    async def keep(self, tenant: str, entry_key: str, ttl_s: float) -> None:
        """Create or refresh the entry for ``ttl_s``; a shorter TTL never cuts a longer one."""
        self._check(tenant, entry_key)
        await self._do(self._keep(keys=[entry_key], args=[_ms(ttl_s)]))


class RateLimiter(_Backed):
    """Per-tenant request and token rates over fixed windows in Redis (shared by every gateway replica). Each
    tenant's counters are its own keys, so one tenant's traffic never uses another's allowance."""

    def __init__(self, client: redis.asyncio.Redis, requests_per_s: int | None, tokens_per_min: int | None) -> None:
        super().__init__(client)
        self.requests_per_s, self.tokens_per_min = requests_per_s, tokens_per_min

    async def admit(self, tenant: str, tokens: int, now: float | None = None) -> float | None:
        """Count one request of ``tokens``; None if it is within the limits, else seconds until it may be
        retried (a refused request still counts: retrying early does not help)."""
        if self.requests_per_s is None and self.tokens_per_min is None:
            return None
        now = time.time() if now is None else now
        second, minute = int(now), int(now // 60)

        async def count():
            async with self.r.pipeline(transaction=True) as pipe:
                if self.requests_per_s is not None:
                    key = f"kvgrid:rate:{tenant}:req:{second}"
                    pipe.incr(key).expire(key, 5)
                if self.tokens_per_min is not None:
                    key = f"kvgrid:rate:{tenant}:tok:{minute}"
                    pipe.incrby(key, tokens).expire(key, 120)
                return (await pipe.execute())[::2]

        replies = await self._do(count())
        if self.requests_per_s is not None:
            if replies.pop(0) > self.requests_per_s:
                return second + 1 - now
        if self.tokens_per_min is not None and replies[0] > self.tokens_per_min:
            return (minute + 1) * 60 - now
        return None
