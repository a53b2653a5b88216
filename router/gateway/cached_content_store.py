"""Cached content objects (``/v1/cachedContents``) in Redis: each tenant's, with its expiry, listed, patched and
deleted by id."""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TypeVar

import redis
import redis.asyncio

from router.gateway.gemini.protocol import CachedContentReply, UsageMetadata
from router.gateway.store_base import LimitExceeded, _Backed, _ms

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class CachedContent:
    id: str
    tenant: str
    content: dict
    token_ids: list[int]
    created: float
    expires: float
    updated: float = 0.0  # when its lifetime was last changed (its creation, until then)

    def public(self) -> CachedContentReply:
        """What the API shows (never the tenant's key material or token ids)."""
        return CachedContentReply(
            name=self.id,
            contents=self.content,
            usageMetadata=UsageMetadata(totalTokenCount=len(self.token_ids)),
            createTime=rfc3339(self.created),
            expireTime=rfc3339(self.expires),
        )


def rfc3339(t: float) -> str:
    """``t`` (seconds since the epoch) as the APIs write times: UTC, microseconds, ``Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


# The per-tenant index of cached content: a sorted set (member = id, score = expiry in ms) and a hash (id ->
# token count). Pruning drops members whose score has passed or whose object Redis already expired, so a clock
# skew between gateways only delays pruning by the skew, and never keeps a vanished object in the list.
_PRUNE = """
local function prune(index, tokens, prefix, now)
  for _, cid in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now)) do
    redis.call('ZREM', index, cid)
    redis.call('HDEL', tokens, cid)
  end
  local live, total = {}, 0
  for _, cid in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    if redis.call('EXISTS', prefix .. cid) == 1 then
      live[#live + 1] = cid
      total = total + tonumber(redis.call('HGET', tokens, cid) or '0')
    else
      redis.call('ZREM', index, cid)
      redis.call('HDEL', tokens, cid)
    end
  end
  return live, total
end
"""

# KEYS: index, tokens, object. ARGV: prefix, now_ms, expires_ms, ttl_ms, body, id, n_tokens, max_count,
# max_tokens (-1 = none). Returns {0} when stored, {1, count} over the count limit, {2, total} over the tokens one.
_CREATE = (
    _PRUNE
    + """
local live, total = prune(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
local n, max_count, max_tokens = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
if max_count >= 0 and #live >= max_count then return {1, #live} end
if max_tokens >= 0 and total + n > max_tokens then return {2, total} end
redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[4])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[6])
redis.call('HSET', KEYS[2], ARGV[6], n)
return {0}
"""
)

# KEYS: index, tokens. ARGV: prefix, now_ms. Returns {id, body, pttl_ms, updated} of the live objects.
_LIST = (
    _PRUNE
    + """
local live = prune(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
local out = {}
for _, cid in ipairs(live) do
  local key = ARGV[1] .. cid
  out[#out + 1] = {cid, redis.call('GET', key), redis.call('PTTL', key), redis.call('GET', key .. ':updated')}
end
return out
"""
)

# KEYS: index, object, the object's update time. ARGV: id, ttl_ms, expires_ms, now (seconds). Returns {body,
# pttl_ms}, or nil if there is no object. The update time is a key of its own (living as long as the object), so a
# new lifetime never rewrites the body with its token ids.
_SET_TTL = """
if redis.call('PEXPIRE', KEYS[2], ARGV[2]) == 0 then return nil end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[2])
return {redis.call('GET', KEYS[2]), redis.call('PTTL', KEYS[2])}
"""

# KEYS: index, tokens, object, its update time. ARGV: id. Returns 1 if there was an object.
_DELETE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[4])
return redis.call('DEL', KEYS[3])
"""


class CachedContentStore(_Backed):
    """Gemini-style cached content objects: Redis expires them with their TTL, and a per-tenant index lists them
    without scanning the keyspace. A tenant may keep at most ``max_per_tenant`` live objects of at most
    ``max_tokens_per_tenant`` tokens together (None: no limit); the check and the insert are one script, so
    concurrent creates cannot pass the limits together."""

    def __init__(
        self, client: redis.asyncio.Redis, max_per_tenant: int | None = None, max_tokens_per_tenant: int | None = None
    ) -> None:
        super().__init__(client)
        self.max_per_tenant, self.max_tokens_per_tenant = max_per_tenant, max_tokens_per_tenant
        self._create = client.register_script(_CREATE)
        self._list = client.register_script(_LIST)
        self._set_ttl = client.register_script(_SET_TTL)
        self._delete = client.register_script(_DELETE)

    @staticmethod
    def _prefix(tenant: str) -> str:
        return f"kvgrid:cc:{tenant}:"

    @staticmethod
    def _index_keys(tenant: str) -> list[str]:
        return [f"kvgrid:cc-index:{tenant}", f"kvgrid:cc-tokens:{tenant}"]

    async def create(self, tenant: str, content: dict, token_ids: list[int], ttl_s: float) -> CachedContent:
        """Store a new object; LimitExceeded if the tenant's limits do not leave room for it."""
        now = time.time()
        cc = CachedContent(f"cachedContents/{secrets.token_hex(12)}", tenant, content, token_ids, now, now + ttl_s, now)
        body = json.dumps({"content": content, "token_ids": token_ids, "created": now})
        prefix = self._prefix(tenant)
        limits = [-1 if m is None else m for m in (self.max_per_tenant, self.max_tokens_per_tenant)]
        reply = await self._do(
            self._create(
                keys=[*self._index_keys(tenant), prefix + cc.id],
                args=[
                    prefix,
                    int(now * 1000),
                    int(cc.expires * 1000),
                    _ms(ttl_s),
                    body,
                    cc.id,
                    len(token_ids),
                    *limits,
                ],
            )
        )
        if reply[0] == 1:
            raise LimitExceeded(
                f"this tenant already keeps {reply[1]} cached contents, its limit "
                "(limits.max_cached_contents); delete one or let one expire first"
            )
        if reply[0] == 2:
            raise LimitExceeded(
                f"this tenant's cached contents hold {reply[1]} tokens; {len(token_ids)} more "
                f"would pass its limit of {self.max_tokens_per_tenant} "
                "(limits.max_cached_content_tokens)"
            )
        return cc

    async def get(self, tenant: str, cid: str) -> CachedContent | None:
        """The tenant's object, or None (also for another tenant's id: indistinguishable from a missing one)."""
        key = self._prefix(tenant) + cid

        async def read():
            async with self.r.pipeline(transaction=True) as pipe:
                return await pipe.get(key).pttl(key).get(key + ":updated").execute()

        body, pttl, updated = await self._do(read())
        return _decode(tenant, cid, body, pttl, updated)

    async def list(self, tenant: str) -> list[CachedContent]:
        """The tenant's live objects, oldest first."""
        rows = await self._do(
            self._list(keys=self._index_keys(tenant), args=[self._prefix(tenant), int(time.time() * 1000)])
        )
        out = [_decode(tenant, cid.decode(), body, pttl, updated) for cid, body, pttl, updated in rows]
        return sorted((c for c in out if c is not None), key=lambda c: c.created)

    async def set_ttl(self, tenant: str, cid: str, ttl_s: float) -> CachedContent | None:
        """Give the object a new lifetime from now; None if it does not exist."""
        key, now = self._prefix(tenant) + cid, time.time()
        reply = await self._do(
            self._set_ttl(
                keys=[self._index_keys(tenant)[0], key, key + ":updated"],
                args=[cid, _ms(ttl_s), int((now + ttl_s) * 1000), repr(now)],
            )
        )
        return None if reply is None else _decode(tenant, cid, reply[0], reply[1], repr(now).encode())

    async def delete(self, tenant: str, cid: str) -> bool:
        """Whether there was such an object (now gone)."""
        return bool(
            await self._do(
                self._delete(
                    keys=[*self._index_keys(tenant), key := self._prefix(tenant) + cid, key + ":updated"], args=[cid]
                )
            )
        )


def _decode(
    tenant: str, cid: str, body: bytes | None, pttl: int | None, updated: bytes | None = None
) -> CachedContent | None:
    if body is None or pttl is None or pttl < 0:
        return None
    data = json.loads(body)
    created = data["created"]
    return CachedContent(
        cid,
        tenant,
        data["content"],
        data["token_ids"],
        created,
        time.time() + pttl / 1e3,
        created if updated is None else float(updated),
    )


# KEYS: entry. ARGV: ttl_ms. Sets the entry unless it already lives at least that long.
