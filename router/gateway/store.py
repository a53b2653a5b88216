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
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

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

    def find(self, tenant: str, key: str | None) -> Any:
        """The stored record of the key (its own limits and budget): config keys have none."""
        return None

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
    def entry_key(tenant: str, tokens: list[int], adapter: str | None = None) -> str:
        """The entry's Redis key for the prefix ``tokens`` of ``tenant`` (under LoRA adapter id ``adapter``: its
        blocks are not the base model's, so neither is its entry)."""
        data = token_bytes(tokens) if adapter is None else adapter.encode() + b"\0" + token_bytes(tokens)
        return f"kvgrid:pin:{tenant}:{xxhash.xxh3_128_hexdigest(data)}"

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


# A sliding-window log per scope and limit: a sorted set of the admissions of the last window (score: time; a
# token member also carries its count, summed in a companion key), so no window of the limit's length ever holds
# more than the limit. Both limits are checked before either counts: a refused request is not counted. The time
# is Redis's own (TIME) unless ARGV[1] gives one, so replicas with skewed clocks agree.
# KEYS: request log, token log, token sum. ARGV: now or "", requests limit or "", tokens limit or "", tokens, id.
# Returns -1 when admitted, else the microseconds until it would be.
_SLIDING_WINDOW = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local max_req, max_tok, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local wait, used = 0, 0
if max_req then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 1)
  local n = redis.call('ZCARD', KEYS[1])
  if n >= max_req then
    local oldest = redis.call('ZRANGE', KEYS[1], n - max_req, n - max_req, 'WITHSCORES')
    wait = math.max(wait, tonumber(oldest[2]) + 1 - now)
  end
end
if max_tok then
  local gone = 0
  used = tonumber(redis.call('GET', KEYS[3]) or '0')
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - 60)) do
    gone = gone + tonumber(string.match(m, '^(%d+):'))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 60)
  used = math.max(0, used - gone)
  if redis.call('ZCARD', KEYS[2]) == 0 then used = 0 end
  if cost > max_tok then
    wait = math.max(wait, 60)
  elseif used + cost > max_tok then
    -- the oldest entries whose expiry frees enough: the last of them says when
    local need, log = used + cost - max_tok, redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    for i = 1, #log, 2 do
      need = need - tonumber(string.match(log[i], '^(%d+):'))
      if need <= 0 then
        wait = math.max(wait, tonumber(log[i + 1]) + 60 - now)
        break
      end
    end
  end
  redis.call('SET', KEYS[3], used, 'PX', 61000)
end
if wait > 0 then
  return math.max(1, math.ceil(wait * 1e6))
end
if max_req then
  redis.call('ZADD', KEYS[1], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[1], 1100)
end
if max_tok and cost > 0 then
  redis.call('ZADD', KEYS[2], now, cost .. ':' .. ARGV[5])
  redis.call('SET', KEYS[3], used + cost, 'PX', 61000)
  redis.call('PEXPIRE', KEYS[2], 61000)
end
return -1
"""


class RateLimiter(_Backed):
    """A scope's request rate (per second) and token rate (per minute), shared by every gateway replica through
    Redis: a sliding-window log checked and updated in one Lua script, so over any second (any minute) at most
    ``requests_per_s`` requests (``tokens_per_min`` tokens) are admitted, whichever replica admits them. A scope
    (a tenant's name) has its own keys, so one scope's traffic never uses another's allowance."""

    def __init__(self, client: redis.asyncio.Redis, requests_per_s: int | None, tokens_per_min: int | None) -> None:
        super().__init__(client)
        self.requests_per_s, self.tokens_per_min = requests_per_s, tokens_per_min
        self._script = client.register_script(_SLIDING_WINDOW)

    async def admit(self, scope: str, tokens: int, now: float | None = None) -> float | None:
        """Count one request of ``tokens`` for ``scope`` if both limits take it now: None. Else nothing is counted
        and the answer is the seconds until they would take it (if nothing else is admitted meanwhile). ``now``
        (seconds) stands in for Redis's clock (tests)."""
        if self.requests_per_s is None and self.tokens_per_min is None:
            return None
        keys = [f"kvgrid:rate:{{{scope}}}:req", f"kvgrid:rate:{{{scope}}}:tok", f"kvgrid:rate:{{{scope}}}:toksum"]
        args = [
            "" if now is None else repr(float(now)),
            "" if self.requests_per_s is None else self.requests_per_s,
            "" if self.tokens_per_min is None else self.tokens_per_min,
            max(0, int(tokens)),
            secrets.token_hex(8),  # a unique member: two requests in the same microsecond are two entries
        ]
        waited = int(await self._do(self._script(keys=keys, args=args)))
        return None if waited < 0 else waited / 1e6
