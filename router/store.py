"""What lives in Redis and outlives a process: tenants and their hashed API keys, the usage ledger, and cached
content objects (with Redis TTLs). Every key is namespaced by tenant, so one tenant's ids mean nothing under
another's."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from common.config import TenantConfig

USAGE_FIELDS = (
    "requests", "prompt_tokens", "cached_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens",
)


def hash_api_key(key: str) -> str:
    """What is stored instead of a key: its SHA-256 (keys are long random strings, so no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


class TenantStore:
    def __init__(self, client) -> None:
        self.r = client

    def register(self, tenants: list[TenantConfig]) -> None:
        """Record each tenant's API keys (hashed), replacing what an earlier start registered."""
        pipe = self.r.pipeline()
        for t in tenants:  # every delete before any set: a key may move from one tenant to another
            for h in self.r.smembers(f"kvgrid:tenant:{t.name}:keys"):
                pipe.delete(f"kvgrid:apikey:{h.decode()}")
            pipe.delete(f"kvgrid:tenant:{t.name}:keys")
        for t in tenants:
            for key in t.api_keys:
                h = hash_api_key(key)
                pipe.set(f"kvgrid:apikey:{h}", t.name)
                pipe.sadd(f"kvgrid:tenant:{t.name}:keys", h)
        pipe.execute()

    def authenticate(self, tenant: str, key: str | None) -> bool:
        """Whether ``key`` is one of ``tenant``'s keys (constant-time on the stored value)."""
        if not key:
            return False
        owner = self.r.get(f"kvgrid:apikey:{hash_api_key(key)}")
        return owner is not None and hmac.compare_digest(owner.decode(), tenant)


class UsageLedger:
    """Per-tenant token counters (Redis hashes): durable across restarts of the server."""

    def __init__(self, client) -> None:
        self.r = client

    def record(self, tenant: str, **counts: int) -> None:
        unknown = set(counts) - set(USAGE_FIELDS)
        if unknown:
            raise ValueError(f"unknown usage fields {sorted(unknown)}")
        pipe = self.r.pipeline()
        for field, n in counts.items():
            if n:
                pipe.hincrby(f"kvgrid:usage:{tenant}", field, n)
        pipe.execute()

    def totals(self, tenant: str) -> dict[str, int]:
        raw = self.r.hgetall(f"kvgrid:usage:{tenant}")
        return {f: int(raw.get(f.encode(), 0)) for f in USAGE_FIELDS}


@dataclass
class CachedContent:
    id: str
    tenant: str
    content: dict
    token_ids: list[int]
    created: float
    expires: float

    def public(self) -> dict:
        """What the API shows (never the tenant's key material or token ids)."""
        return {
            "name": self.id,
            "contents": self.content,
            "usageMetadata": {"totalTokenCount": len(self.token_ids)},
            "createTime": _iso(self.created),
            "expireTime": _iso(self.expires),
        }


class CachedContentStore:
    """Gemini-style cached content objects; Redis expires them with their TTL."""

    def __init__(self, client) -> None:
        self.r = client

    def _key(self, tenant: str, cid: str) -> str:
        return f"kvgrid:cc:{tenant}:{cid}"

    def create(self, tenant: str, content: dict, token_ids: list[int], ttl_s: float) -> CachedContent:
        now = time.time()
        cc = CachedContent(f"cachedContents/{secrets.token_hex(12)}", tenant, content, token_ids, now, now + ttl_s)
        self._save(cc, ttl_s)
        return cc

    def _save(self, cc: CachedContent, ttl_s: float) -> None:
        body = json.dumps({"content": cc.content, "token_ids": cc.token_ids, "created": cc.created})
        self.r.set(self._key(cc.tenant, cc.id), body, px=max(1, int(ttl_s * 1000)))

    def get(self, tenant: str, cid: str) -> CachedContent | None:
        """The tenant's object, or None (also for another tenant's id: indistinguishable from a missing one)."""
        key = self._key(tenant, cid)
        pipe = self.r.pipeline()
        pipe.get(key)
        pipe.pttl(key)
        body, pttl = pipe.execute()
        if body is None or pttl is None or pttl < 0:
            return None
        data = json.loads(body)
        return CachedContent(cid, tenant, data["content"], data["token_ids"], data["created"], time.time() + pttl / 1e3)

    def list(self, tenant: str) -> list[CachedContent]:
        prefix = f"kvgrid:cc:{tenant}:"
        out = []
        for key in self.r.scan_iter(match=prefix + "*"):
            cc = self.get(tenant, key.decode()[len(prefix) :])
            if cc is not None:
                out.append(cc)
        return sorted(out, key=lambda c: c.created)

    def set_ttl(self, tenant: str, cid: str, ttl_s: float) -> CachedContent | None:
        cc = self.get(tenant, cid)
        if cc is None:
            return None
        self.r.pexpire(self._key(tenant, cid), max(1, int(ttl_s * 1000)))
        cc.expires = time.time() + ttl_s
        return cc

    def delete(self, tenant: str, cid: str) -> bool:
        return bool(self.r.delete(self._key(tenant, cid)))


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


class RateLimiter:
    """Per-tenant request and token rates over fixed windows in Redis (shared by every gateway replica). Each
    tenant's counters are its own keys, so one tenant's traffic never uses another's allowance."""

    def __init__(self, client, requests_per_s: int | None, tokens_per_min: int | None) -> None:
        self.r = client
        self.requests_per_s, self.tokens_per_min = requests_per_s, tokens_per_min

    def admit(self, tenant: str, tokens: int, now: float | None = None) -> float | None:
        """Count one request of ``tokens``; None if it is within the limits, else seconds until it may be
        retried (a refused request still counts: retrying early does not help)."""
        if self.requests_per_s is None and self.tokens_per_min is None:
            return None
        now = time.time() if now is None else now
        second, minute = int(now), int(now // 60)
        pipe = self.r.pipeline()
        if self.requests_per_s is not None:
            key = f"kvgrid:rate:{tenant}:req:{second}"
            pipe.incr(key)
            pipe.expire(key, 5)
        if self.tokens_per_min is not None:
            key = f"kvgrid:rate:{tenant}:tok:{minute}"
            pipe.incrby(key, tokens)
            pipe.expire(key, 120)
        replies = pipe.execute()[::2]
        if self.requests_per_s is not None:
            count = replies.pop(0)
            if count > self.requests_per_s:
                return second + 1 - now
        if self.tokens_per_min is not None and replies[0] > self.tokens_per_min:
            return (minute + 1) * 60 - now
        return None
