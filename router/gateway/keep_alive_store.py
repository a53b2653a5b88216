"""The keep-alive service's state in Redis: each explicit entry's reuse next to the entry, the tenant's index of
entries by expiry, the entries' tokens a keep re-pins, and the decisions, each applied as a compare-and-set on the
entry's expiry (of replicas deciding the same entry in the same round, one wins, so an entry is never extended or
billed twice)."""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio

from common.hashing import token_bytes
from router.gateway.economics import HISTORY, Decision, Reuse
from router.gateway.store import EntryStore, _Backed

STATS_LIFE_S = 86400.0  # an entry's reuse is forgotten this long after its last use
ROUND_BATCH = 512  # entries decided per tenant per round, at most
TOKENS_SLACK_S = 60.0  # an entry's stored tokens outlive its expiry by this much (its re-pin reads them after a keep)
ENTRY_PREFIX = "kvgrid:pin:"  # EntryStore.entry_key's


# KEYS: stats, index, tokens. ARGV: member, now_ms, ttl_ms, n_tokens, history, life_ms, hit, slack_ms. Returns 1
# when the entry's tokens are wanted (it was used before, and they are not stored), else 0. An existing tokens key
# is made to outlive the entry's expiry by the slack.
_NOTE_USE = """
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local last = tonumber(redis.call('HGET', KEYS[1], 'last') or '-1')
if last >= 0 and now > last then
  local gaps = {}
  local old = redis.call('HGET', KEYS[1], 'gaps')
  if old then for g in string.gmatch(old, '[^,]+') do gaps[#gaps + 1] = g end end
  gaps[#gaps + 1] = string.format('%d', now - last)
  while #gaps > tonumber(ARGV[5]) do table.remove(gaps, 1) end
  redis.call('HSET', KEYS[1], 'gaps', table.concat(gaps, ','))
end
if now > last then redis.call('HSET', KEYS[1], 'last', ARGV[2]) end
redis.call('HINCRBY', KEYS[1], 'uses', 1)
redis.call('HINCRBY', KEYS[1], 'hits', ARGV[7])
redis.call('HSET', KEYS[1], 'ttl', ARGV[3], 'n', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
local score = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or '-1')
if now + ttl > score then
  score = now + ttl
  redis.call('ZADD', KEYS[2], score, ARGV[1])
end
redis.call('PEXPIRE', KEYS[2], ARGV[6])
local pttl = redis.call('PTTL', KEYS[3])
if pttl == -2 then
  if last >= 0 then return 1 end
  return 0
end
local life = score - now + tonumber(ARGV[8])
if pttl >= 0 and pttl < life then redis.call('PEXPIRE', KEYS[3], math.floor(life)) end
return 0
"""

# The tokens of an entry used again, kept until its expiry in the index plus the slack. KEYS: tokens, index.
# ARGV: member, now_ms, slack_ms, tokens.
_PUT_TOKENS = """
local score = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or '-1')
local life = score - tonumber(ARGV[2]) + tonumber(ARGV[3])
if score >= 0 and life > 0 then redis.call('SET', KEYS[1], ARGV[4], 'PX', math.floor(life)) end
"""

# A decision, applied only if the entry's expiry in the index is still the one decided on (another replica, or a
# hit, has not changed it meanwhile). KEYS: index, entry, counters, tokens. ARGV: member, old_ms, new_ms (-1: drop),
# now_ms, kept token-seconds, slack_ms, life_ms. Returns 1 when applied, 0 when the entry had changed, -1 when it
# had expired. A drop deletes the entry's tokens (a later use stores them again); a keep makes them outlive it.
_DECIDE = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
local new = tonumber(ARGV[3])
local gone = new < 0 or redis.call('PTTL', KEYS[2]) == -2
if gone then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[4])
  redis.call('HINCRBY', KEYS[3], 'drop', 1)
  if new < 0 then return 1 end
  return -1
end
local left = new - tonumber(ARGV[4])
local pttl = redis.call('PTTL', KEYS[2])
if pttl >= 0 and pttl < left then redis.call('PEXPIRE', KEYS[2], math.floor(left)) end
local tp = redis.call('PTTL', KEYS[4])
local life = left + tonumber(ARGV[6])
if tp >= 0 and tp < life then redis.call('PEXPIRE', KEYS[4], math.floor(life)) end
redis.call('ZADD', KEYS[1], new, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('HINCRBY', KEYS[3], 'keep', 1)
redis.call('HINCRBY', KEYS[3], 'kept_token_seconds', ARGV[5])
return 1
"""


def _member(tenant: str, entry_key: str) -> str:
    EntryStore._check(tenant, entry_key)
    return entry_key[len(f"{ENTRY_PREFIX}{tenant}:") :]


def _tokens_of(raw: bytes) -> list[int]:
    arr = array.array("I")
    arr.frombytes(raw)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


@dataclass(frozen=True)
class DueEntry:
    """An entry near its expiry, with what ``decide`` needs."""

    tenant: str
    member: str
    expires_ms: int
    tokens: int
    ttl_s: float
    reuse: Reuse | None  # None: its reuse was forgotten (``STATS_LIFE_S``)

    @property
    def entry_key(self) -> str:
        return f"{ENTRY_PREFIX}{self.tenant}:{self.member}"


class EntryReuse(_Backed):
    """Each explicit entry's reuse, next to the entry (``EntryStore``'s ``kvgrid:pin:{tenant}:{h}``): a hash
    ``kvgrid:keep:{tenant}:{h}`` (last use, recent gaps, uses, hits, TTL, token count), forgotten
    ``STATS_LIFE_S`` after the last use; the entry's tokens, which a keep re-pins (``kvgrid:keep-tokens:{tenant}:{h}``,
    stored from its second use on, living until the entry's expiry plus ``TOKENS_SLACK_S``, deleted with a drop);
    the tenant's index of entries by expiry (``kvgrid:keep-index:{tenant}``, a sorted set, ms, forgotten
    ``STATS_LIFE_S`` after its last write) that the background task decides from; and the tenant's decision
    counters (``kvgrid:keep-alive:{tenant}``: keep, drop, kept_token_seconds)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        super().__init__(client)
        self._note = client.register_script(_NOTE_USE)
        self._put_tokens = client.register_script(_PUT_TOKENS)
        self._decide = client.register_script(_DECIDE)

    @staticmethod
    def stats_key(tenant: str, member: str) -> str:
        return f"kvgrid:keep:{tenant}:{member}"

    @staticmethod
    def tokens_key(tenant: str, member: str) -> str:
        return f"kvgrid:keep-tokens:{tenant}:{member}"

    @staticmethod
    def index_key(tenant: str) -> str:
        return f"kvgrid:keep-index:{tenant}"

    @staticmethod
    def counters_key(tenant: str) -> str:
        return f"kvgrid:keep-alive:{tenant}"

    async def note_use(
        self, tenant: str, entry_key: str, tokens: Sequence[int], ttl_s: float, hit: bool, now: float
    ) -> None:
        """One use of the entry (a request with its breakpoint) at ``now``. Its tokens are sent only when they are
        wanted: from its second use on, while they are not stored."""
        member = _member(tenant, entry_key)
        index, tokens_key, now_ms = self.index_key(tenant), self.tokens_key(tenant, member), int(now * 1000)
        slack_ms = int(TOKENS_SLACK_S * 1000)
        args: list[str | int] = [
            member,
            now_ms,
            max(1, int(ttl_s * 1000)),
            len(tokens),
            HISTORY,
            int(STATS_LIFE_S * 1000),
            int(hit),
        ]
        wanted = await self._do(
            self._note(keys=[self.stats_key(tenant, member), index, tokens_key], args=[*args, slack_ms])
        )
        if int(wanted):
            await self._do(
                self._put_tokens(keys=[tokens_key, index], args=[member, now_ms, slack_ms, token_bytes(tokens)])
            )

    async def due(self, tenant: str, before: float, limit: int = ROUND_BATCH) -> list[DueEntry]:
        """The tenant's entries expiring before ``before``, soonest first, with their reuse."""
        rows: list[Any] = list(
            await self._do(
                self.r.zrangebyscore(self.index_key(tenant), "-inf", int(before * 1000), 0, limit, withscores=True)
            )
        )
        if not rows:
            return []

        async def read():
            async with self.r.pipeline(transaction=False) as pipe:
                for member, _ in rows:
                    pipe.hmget(self.stats_key(tenant, member.decode()), "last", "gaps", "uses", "hits", "ttl", "n")
                return await pipe.execute()

        out = []
        for (member, score), (last, gaps, uses, hits, ttl, n) in zip(rows, await self._do(read())):
            reuse = None
            if last is not None:
                reuse = Reuse(
                    int(last) / 1000,
                    tuple(int(g) / 1000 for g in gaps.split(b",")) if gaps else (),
                    int(uses or 1),
                    int(hits or 0),
                )
            out.append(DueEntry(tenant, member.decode(), int(score), int(n or 0), int(ttl or 1000) / 1000, reuse))
        return out

    async def apply(self, entry: DueEntry, decision: Decision, now: float, kept_token_s: int = 0) -> int:
        """Apply ``decision`` unless the entry changed since it was read: 1 applied, 0 changed (another replica
        decided it, or a request used it), -1 it had expired (counted as a drop)."""
        new = int(decision.until * 1000) if decision.keep else -1
        return int(
            await self._do(
                self._decide(
                    keys=[
                        self.index_key(entry.tenant),
                        entry.entry_key,
                        self.counters_key(entry.tenant),
                        self.tokens_key(entry.tenant, entry.member),
                    ],
                    args=[
                        entry.member,
                        entry.expires_ms,
                        new,
                        int(now * 1000),
                        kept_token_s,
                        int(TOKENS_SLACK_S * 1000),
                        int(STATS_LIFE_S * 1000),
                    ],
                )
            )
        )

    async def tokens(self, entry: DueEntry) -> list[int] | None:
        raw = await self._do(self.r.get(self.tokens_key(entry.tenant, entry.member)))
        return None if raw is None else _tokens_of(bytes(raw, "latin-1") if isinstance(raw, str) else raw)

    async def counters(self, tenant: str) -> dict[str, int]:
        raw = await self._do(self.r.hgetall(self.counters_key(tenant)))
        return {f: int(raw.get(f.encode(), 0)) for f in ("keep", "drop", "kept_token_seconds")}
