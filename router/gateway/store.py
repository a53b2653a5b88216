"""State the gateways share through Redis: the usage ledger, cached content objects, explicit cache entries and
rate-limit counters. Every key is namespaced by tenant, so one tenant's ids mean nothing under another's.

Redis is never in the way of a request for long: the request-path methods are async (``redis.asyncio``), each
one is bounded by twice the client's timeout (``connect``), and every Redis failure or timeout surfaces as
``StoreUnavailable`` (the gateway answers 503 with Retry-After). API keys are checked in memory (``KeyRing``),
and usage is buffered in the process (``UsageLedger``), so neither depends on Redis being up."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import redis
import redis.asyncio
import xxhash
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from common.config import ServeConfig
from common.hashing import token_bytes
from router.gateway.protocol import CachedContentReply, UsageMetadata

log = logging.getLogger(__name__)

T = TypeVar("T")

USAGE_FIELDS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "cache_write_tokens",
    "cache_read_tokens",
    # Writes by the TTL they were priced at, and the token-seconds of storage those writes were billed for.
    "cache_write_5m_tokens",
    "cache_write_1h_tokens",
    "storage_token_seconds",
    # Money in pico-dollars (router/gateway/economics.py): what the traffic cost, and would have without the cache.
    # In Redis each of these carries whole dollars into a field of its own (``cost_usd``...), so no counter
    # overflows; every reader gets the sum back in pico-dollars.
    "cost_pusd",
    "uncached_cost_pusd",
)
_PICO = 10**12


class StoreUnavailable(Exception):
    """Redis failed or did not answer in time; the operation may be retried later."""


class LimitExceeded(Exception):
    """A tenant's limit refused the write; the message names the limit."""


def hash_api_key(key: str) -> str:
    """What is kept instead of a key: its SHA-256 (keys are long random strings, so no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def connect(url: str, timeout_s: float = 1.0) -> redis.asyncio.Redis:
    """An async client whose every connect, read and write gives up after ``timeout_s``. A dropped connection
    (Redis restarted) is retried once on a fresh one; a timeout is not retried (a paused Redis would only cost
    another timeout)."""
    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )


def with_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` added, unless it has one already (or there is none to add)."""
    if not password:
        return url
    parts = urlsplit(url)
    if parts.password is not None or "password=" in parts.query:
        return url
    if parts.scheme == "unix":  # no host part to carry it: redis-py reads it from the query
        return f"{url}{'&' if parts.query else '?'}password={quote(password, safe='')}"
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


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


async def _bounded(deadline_s: float, op: Awaitable[T]) -> T:
    """``op``'s result; StoreUnavailable if Redis fails or ``deadline_s`` passes first."""
    try:
        async with asyncio.timeout(deadline_s):
            return await op
    except (redis.RedisError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(f"redis unavailable: {str(exc) or type(exc).__name__}") from None


def _timeout_of(client: redis.asyncio.Redis) -> float:
    return client.connection_pool.connection_kwargs.get("socket_timeout") or 1.0


class _Backed:
    """Holds the client and bounds every operation by its socket timeout (a few round trips each)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.r = client
        # One operation may take a connect and a read; past this the caller gets StoreUnavailable, whatever
        # redis-py is still waiting for.
        self.deadline_s = 2 * _timeout_of(client)

    async def _do(self, op: Awaitable[T]) -> T:
        return await _bounded(self.deadline_s, op)


# Applies one batch of usage counts unless this ledger's batch ``seq`` was applied already, so a batch whose
# reply was lost can be sent again without counting twice.
_APPLY_USAGE = """
local done = tonumber(redis.call('GET', KEYS[1]) or '0')
local seq = tonumber(ARGV[1])
if done >= seq then return 0 end
for i = 2, #KEYS do
  local field = ARGV[2 * i - 2]
  local v = redis.call('HINCRBY', KEYS[i], field, ARGV[2 * i - 1])
  if string.sub(field, -5) == '_pusd' and v >= 1e12 then  -- carry whole dollars: the field stays small
    local carry = math.floor(v / 1e12)
    redis.call('HINCRBY', KEYS[i], string.sub(field, 1, -6) .. '_usd', string.format('%.0f', carry))
    redis.call('HINCRBY', KEYS[i], field, string.format('%.0f', -carry * 1e12))
  end
end
redis.call('SET', KEYS[1], seq, 'EX', 86400)
return 1
"""


class UsageLedger:
    """Per-tenant token counters (Redis hashes ``kvgrid:usage:{tenant}``), durable across restarts.

    ``record`` only adds to a buffer in this process; a background task writes the buffer to Redis every
    ``flush_interval_s`` in one atomic script. While Redis is down the buffer is kept and retried, so nothing
    recorded is lost as long as the process lives; each batch carries a sequence number, so one that reached
    Redis but whose reply did not is never counted twice."""

    def __init__(self, client: redis.asyncio.Redis, flush_interval_s: float = 0.2) -> None:
        self.r = client
        self.interval_s = flush_interval_s
        self.deadline_s = 2 * _timeout_of(client)
        self._id = secrets.token_hex(8)  # this ledger's sequence numbers are its own
        self._seq = 0
        self._pending: dict[str, dict[str, int]] = {}
        self._sending: tuple[int, dict[str, dict[str, int]]] | None = None  # sent, not yet acknowledged
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._apply = client.register_script(_APPLY_USAGE)

    def record(self, tenant: str, **counts: int) -> None:
        """Add ``counts`` (fields of ``USAGE_FIELDS``) to ``tenant``'s totals. Never blocks, never touches
        Redis; a ValueError only for an unknown field (a bug in the caller)."""
        unknown = set(counts) - set(USAGE_FIELDS)
        if unknown:
            raise ValueError(f"unknown usage fields {sorted(unknown)}")
        mine = self._pending.setdefault(tenant, {})
        for field, n in counts.items():
            if n:
                mine[field] = mine.get(field, 0) + int(n)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop here: whoever owns the ledger calls flush()
            return
        self.start()

    def start(self) -> None:
        """Start the background flusher in the running event loop (``record`` does it on first use)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._stop = asyncio.Event()  # of this loop, unset
            self._task = loop.create_task(self._flush_forever(), name="kvgrid-usage-flush")

    async def _flush_forever(self) -> None:
        failing = False  # log when writing stops and starts working again, not every round in between
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
                return  # close(): it writes the rest
            except TimeoutError:
                pass
            try:
                await self.flush()
            except StoreUnavailable as exc:  # kept in the buffer; the next round tries again
                if not failing:
                    log.warning("usage ledger: %s; buffering usage until Redis is back", exc)
                failing = True
                continue
            if failing:
                log.warning("usage ledger: Redis is back; buffered usage written")
            failing = False

    async def flush(self) -> None:
        """Write what was recorded before this call to Redis; StoreUnavailable (and the counts kept) if Redis
        fails."""
        await _bounded(self.deadline_s, self._write())

    async def _write(self) -> None:
        # At most two rounds: the batch already in flight (if any), then what was pending at the call.
        for _ in range(2):
            if self._sending is None:
                if not self._pending:
                    return
                self._seq += 1
                self._sending, self._pending = (self._seq, self._pending), {}
            batch = self._sending
            seq, counts = batch
            keys = [self._seq_key]
            args: list[str | int] = [seq]
            for tenant, fields in counts.items():
                for field, n in fields.items():
                    keys.append(f"kvgrid:usage:{tenant}")
                    args += [field, n]
            await self._apply(keys=keys, args=args)
            if self._sending is batch:  # another flush may have sent it meanwhile (a no-op in Redis)
                self._sending = None

    @property
    def _seq_key(self) -> str:
        return f"kvgrid:usage-seq:{self._id}"

    async def totals(self, tenant: str) -> dict[str, int]:
        """``tenant``'s counters, including what is still buffered here."""
        # What is buffered now, and the sequence numbers it will reach Redis under: Redis's applied sequence
        # number (read atomically with the counters) tells which of it the counters hold already.
        sending, pending, pending_seq = self._sending, dict(self._pending.get(tenant, {})), self._seq + 1

        async def read():
            async with self.r.pipeline(transaction=True) as pipe:
                return await pipe.hgetall(f"kvgrid:usage:{tenant}").get(self._seq_key).execute()

        raw, done = await _bounded(self.deadline_s, read())
        done = int(done or 0)
        out = _usage_of(raw)
        buffered = [(pending_seq, pending)]
        if sending is not None:
            buffered.append((sending[0], sending[1].get(tenant, {})))
        for seq, counts in buffered:
            if done < seq:  # not in Redis's counters yet
                for f, n in counts.items():
                    out[f] += n
        return out

    async def close(self) -> None:
        """Stop the background flusher and write what is buffered (StoreUnavailable if Redis is down: those
        counts are lost with the process)."""
        task, self._task = self._task, None
        if task is not None:  # stopped between rounds, never cancelled inside a Redis call (which can hang it)
            self._stop.set()
            await asyncio.wait({task}, timeout=2 * self.deadline_s)
            if not task.done():
                task.cancel()
        await self.flush()


def read_usage(client: redis.Redis, tenant: str) -> dict[str, int]:
    """``tenant``'s counters as Redis holds them, with a synchronous client (tools and tests; a gateway's
    ledger may still buffer a fraction of a second of usage)."""
    return _usage_of(client.hgetall(f"kvgrid:usage:{tenant}"))


def _usage_of(raw: Mapping) -> dict[str, int]:
    """The counters of a Redis usage hash; money in pico-dollars (the carried whole dollars added back)."""
    out = {f: int(raw.get(f.encode(), 0)) for f in USAGE_FIELDS}
    for f in USAGE_FIELDS:
        if f.endswith("_pusd"):
            out[f] += int(raw.get(f.removesuffix("_pusd").encode() + b"_usd", 0)) * _PICO
    return out


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


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


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
