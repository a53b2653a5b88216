"""Keep-alive of explicit cache entries (issue 17, part 3): per tenant ``keep_alive: off | auto``.

With ``auto`` the gateway keeps a ``cache_control`` entry warm past its TTL only while the entry's observed reuse
makes rebuilding it cost more than keeping it, at the tenant's prices (router/gateway/economics.py):

- **keeping** an entry of ``T`` tokens costs its storage (``storage`` per token-hour) for the time kept; a tenant
  whose prices have no storage (Anthropic bills no storage: an entry is held by refreshing it) pays for the held
  capacity what the vendor charges to hold it, one refresh, a read of its ``T`` tokens at ``cache_read``, per TTL,
  pro rata (``hold_cost``);
- **rebuilding** it costs the write price over the read price of its tokens (``economics.rebuild_cost``) plus the
  storage a new write is billed for its TTL (``rebuild_premium``).

The rule is ``decide`` (a pure function, the same in the gateway and in ``kvgrid bench keep-alive``'s replay).
Each entry's reuse (its last use, the gaps between its last ``HISTORY`` uses, uses and hits) is kept in Redis
next to the entry (``EntryReuse``), so every gateway replica decides the same; a background task of every
replica (``KeepAlive``) decides, shortly before an entry expires, whether to extend it by one more TTL. A keep
extends the Redis entry and re-pins its blocks on a group by the same request a hit sends (``Gateway.generate``
with the entry's tokens and TTL, as cached contents are pinned), and the time kept is billed as storage in the
usage ledger (``storage_token_seconds``, ``cost_pusd``: ``GET /{tenant}/v1/usage``). Each decision is a
compare-and-set on the entry's expiry in Redis: of replicas deciding the same entry in the same round, one wins,
so an entry is never extended (or billed) twice.

Cached contents (``/v1/cachedContents``, the Gemini API) are not kept alive: their lifetime is the one the user
chose (``ttl`` / ``expireTime``) and changes only when the user updates it."""

from __future__ import annotations

import array
import asyncio
import logging
import math
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.asyncio
from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily

from common.config import PricesConfig
from common.hashing import token_bytes
from router.gateway.economics import PRESETS, SHORT_TTL_S, Prices, dollars, keep_cost, rebuild_cost
from router.gateway.store import EntryStore, StoreUnavailable, _Backed

if TYPE_CHECKING:
    from router.gateway.core import Gateway, Tenant

log = logging.getLogger(__name__)

HISTORY = 8  # the gaps between an entry's last uses that its reuse keeps
MARGIN = 2.0  # an entry is expected back within this many times its longest recent gap
STATS_LIFE_S = 86400.0  # an entry's reuse is forgotten this long after its last use
MAX_PERIOD_S = 2.0  # the background task's round, at most...
MIN_PERIOD_S = 0.05
PERIOD_ENV = "KVGRID_KEEP_ALIVE_PERIOD_S"  # ...or exactly this (a test's or an operator's override)
ROUND_BATCH = 512  # entries decided per tenant per round, at most
REPIN_TIMEOUT_S = 60.0
CLOSE_S = 2.0  # a stopping replica waits this long for a round in progress
TOKENS_SLACK_S = 60.0  # an entry's stored tokens outlive its expiry by this much (its re-pin reads them after a keep)
LOG_EVERY_S = 60.0  # a tenant whose rounds keep failing is logged at most this often
ENTRY_PREFIX = "kvgrid:pin:"  # EntryStore.entry_key's


# -- the rule ----------------------------------------------------------------------------------------------------


def hold_cost(prices: Prices, tokens: int, seconds: float, ttl_s: float) -> int:
    """What holding an entry of ``tokens`` for ``seconds`` past its TTL costs (pico-dollars): storage at the
    tenant's ``storage`` price, or, for prices without storage, one refresh (a read of its tokens) per TTL, pro
    rata."""
    if prices.storage:
        return keep_cost(prices, tokens, seconds)
    return round(tokens * prices.cache_read * seconds / ttl_s)


def hold_rate(prices: Prices, tokens: int, ttl_s: float) -> float:
    """``hold_cost`` per second (pico-dollars)."""
    if prices.storage:
        return prices.storage * tokens / 3600.0
    return tokens * prices.cache_read / ttl_s


def rebuild_premium(prices: Prices, tokens: int, ttl_s: float) -> int:
    """What an expired entry's next use costs over a read of it (pico-dollars): writing it again instead of
    reading (``economics.rebuild_cost``) and the storage a new write is billed for its TTL."""
    return rebuild_cost(prices, tokens, ttl_s) + keep_cost(prices, tokens, ttl_s)


@dataclass(frozen=True)
class Reuse:
    """An entry's observed reuse: its last use (seconds since the epoch), the gaps between its most recent uses
    (seconds, oldest first, at most ``HISTORY``), and how many uses and hits (uses that found it alive) it had."""

    last: float
    gaps: tuple[float, ...] = ()
    uses: int = 1
    hits: int = 0

    def used(self, now: float, hit: bool, history: int = HISTORY) -> Reuse:
        """This reuse after one more use at ``now``."""
        gaps = (*self.gaps, now - self.last)[-history:] if now > self.last else self.gaps
        return Reuse(max(self.last, now), gaps, self.uses + 1, self.hits + int(hit))


@dataclass(frozen=True)
class Decision:
    keep: bool
    until: float  # the entry's new expiry when kept, else its expiry
    reason: str


def keep_budget(prices: Prices, tokens: int, ttl_s: float) -> float:
    """``B``: the seconds past its TTL that one rebuild of an entry pays for holding it (0: rebuilding costs no
    more than reading)."""
    premium = rebuild_premium(prices, tokens, ttl_s)
    if premium <= 0:
        return 0.0
    rate = hold_rate(prices, tokens, ttl_s)
    return math.inf if rate <= 0 else premium / rate


def never_keeps(prices: Prices) -> str | None:
    """Why ``decide`` keeps no entry at all at these prices, whatever its tokens, TTL and reuse (None: it may
    keep some). Step 1 of ``decide`` does not depend on the tokens or the TTL within a write price, so one TTL of
    each write price (5 minutes, 1 hour) tells."""
    if not prices.priced:
        return "the tenant has no prices"
    budgets = [keep_budget(prices, 1_000_000, ttl) for ttl in (SHORT_TTL_S, 3600.0)]
    if any(b > ttl for b, ttl in zip(budgets, (SHORT_TTL_S, 3600.0))):
        return None
    if all(b <= 0 for b in budgets):
        return "a cache write costs no more than a cache read"
    return "holding an entry one more TTL costs as much as rebuilding it"


def decide(prices: Prices, tokens: int, ttl_s: float, reuse: Reuse, expires: float, margin: float = MARGIN) -> Decision:
    """Whether to keep an entry of ``tokens`` (TTL ``ttl_s``, reused as ``reuse``) alive past ``expires``, and
    until when. A ski-rental rule with the entry's own reuse as the prediction:

    1. ``W`` = ``rebuild_premium`` (what letting it expire costs at its next use), ``r`` = ``hold_rate`` (what
       holding it costs per second), ``B = W / r`` (the seconds past its TTL that one rebuild pays for). If
       ``W`` <= 0, drop: rebuilding costs nothing more than reading. If ``B`` <= ``ttl_s``, drop: holding it one
       more TTL costs a rebuild already (OpenAI-like prices: no write fee, a refresh at half the input price).
    2. No gap seen yet (one use): drop. An entry is kept only once its reuse shows that it comes back.
    3. ``g`` = the longest of its recent gaps: its next use is expected within ``g`` of its last one. If holding
       it from its TTL to then costs a rebuild or more (``g - ttl_s >= B``), drop.
    4. It is held at most until ``deadline = last use + min(margin * g, ttl_s + B)``: past its expected reuse
       (with a margin) it is taken for dead, and it is never held longer past its TTL than one rebuild pays for
       (the ski-rental bound: a wrong prediction costs at most one rebuild more than knowing the future would).
       If ``expires`` >= deadline, drop; else keep until ``min(expires + ttl_s, deadline)``.

    So a hot entry (reused every few minutes) is kept between its uses; a cold one (used once, or again after
    hours) and a bursty one (uses seconds apart, bursts hours apart) are dropped; an entry whose reuse stops is
    dropped at its deadline, and one whose gaps grow past what pays is dropped once such a gap is among its
    recent ones (and kept again once it is not). The decision depends on the entry's stored state only (not on
    the clock), so every gateway replica makes the same one."""
    budget = keep_budget(prices, tokens, ttl_s)  # seconds past its TTL that one rebuild pays for
    if budget <= 0:
        return Decision(False, expires, "rebuilding costs no more than reading")
    if budget <= ttl_s:
        return Decision(False, expires, "holding it one more TTL costs a rebuild")
    if not reuse.gaps:
        return Decision(False, expires, "no reuse seen yet")
    gap = max(reuse.gaps)
    if gap - ttl_s >= budget:
        return Decision(False, expires, "its reuse comes too late for keeping to pay")
    deadline = reuse.last + min(margin * gap, ttl_s + budget)
    if expires >= deadline:
        return Decision(False, expires, "past its expected reuse")
    return Decision(True, min(expires + ttl_s, deadline), "rebuilding would cost more than keeping")


# -- Redis: each entry's reuse, the index of entries to decide, the decisions ------------------------------------

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


# -- the gateway's background task ---------------------------------------------------------------------------------


class _TenantCounters:
    """A tenant's keep-alive series on its own metrics (``GET /{tenant}/metrics``: this replica's decisions, merged
    there with every other replica's), labelled like the rest of them (``tenant``, ``model_name``)."""

    def __init__(self, t: Tenant) -> None:
        r, name, model = t.metrics.registry, t.name, t.metrics.model_name
        lbl = ["tenant", "model_name"]
        decisions = Counter(
            "kvgrid_keep_alive_decisions",
            "Keep-alive decisions on explicit entries",
            [*lbl, "decision"],
            registry=r,
        )
        self.keep, self.drop = decisions.labels(name, model, "keep"), decisions.labels(name, model, "drop")
        self.kept = Counter(
            "kvgrid_keep_alive_kept_token_seconds", "Token-seconds kept past their TTL", lbl, registry=r
        ).labels(name, model)
        self.cost = Counter(
            "kvgrid_keep_alive_cost_dollars",
            "What keeping entries alive cost at the tenant's prices",
            lbl,
            registry=r,
        ).labels(name, model)


def period_from_env() -> float | None:
    """``$KVGRID_KEEP_ALIVE_PERIOD_S``: a finite number of seconds > 0, or None when unset (or empty)."""
    raw = os.environ.get(PERIOD_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{PERIOD_ENV}={raw!r}: must be a finite number of seconds > 0")
    return value


class KeepAlive:
    """One gateway replica's keep-alive: it notes every use of an explicit entry of a tenant with
    ``keep_alive: auto`` (``used``) and, every round (``period_s``: a quarter of the shortest TTL noted, at most
    ``MAX_PERIOD_S``, or ``$KVGRID_KEEP_ALIVE_PERIOD_S``), decides the entries that expire within two rounds."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.store = EntryReuse(gw.redis)
        self.auto = {name: t for name, t in gw.tenants.items() if t.config.keep_alive == "auto"}
        self.counters = {name: _TenantCounters(t) for name, t in gw.tenants.items()}
        self.fixed_period_s = period_from_env()
        self.period_s = self.fixed_period_s or MAX_PERIOD_S
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._closed = False
        self._applying: set[asyncio.Task] = set()  # decisions being applied (shielded from a round's cancelling)
        for name, t in self.auto.items():
            if (why := never_keeps(t.prices)) is not None:
                log.warning("tenant %s has keep_alive: auto, but no entry of it is ever kept: %s", name, why)

    def start(self) -> None:
        """Start the background task in the running event loop (if a tenant has ``auto``; idempotent; never again
        once closed)."""
        if not self.auto or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop yet: the first ``used`` starts it
            return
        if self._task is None or self._task.done():
            self._stop, self._wake = asyncio.Event(), asyncio.Event()
            self._task = loop.create_task(self._run(), name="kvgrid-keep-alive")

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            self._stop.set()
            self._wake.set()
            await asyncio.wait({task}, timeout=CLOSE_S)
            if not task.done():
                task.cancel()
        if self._applying:  # a cancelled round's decision in progress: applied and billed before the ledger closes
            await asyncio.wait(set(self._applying), timeout=CLOSE_S)

    def used(
        self,
        t: Tenant,
        prompt: Sequence[int],
        entries: dict[int, str],
        ttl_at: dict[int, float],
        alive: Iterable[float | None],
    ) -> list[asyncio.Task]:
        """Note a request's use of its entries (position -> entry key, TTL per position, and whether each was
        alive when the request came); the Redis writes, for the request to settle. Nothing for a tenant without
        ``auto``."""
        if t.name not in self.auto or not entries:
            return []
        now = time.time()
        self.start()
        if self.fixed_period_s is None:
            period = max(MIN_PERIOD_S, min(MAX_PERIOD_S, min(ttl_at.values()) / 4))
            if period < self.period_s:
                self.period_s = period
                self._wake.set()
        return [
            self.gw.spawn(self.store.note_use(t.name, key, prompt[:pos], ttl_at[pos], left is not None, now))
            for (pos, key), left in zip(entries.items(), alive)
        ]

    async def _run(self) -> None:
        failing: dict[str, float] = {}  # tenant -> when its failing round was last logged (monotonic)
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), self.period_s)
            except TimeoutError:
                pass
            self._wake.clear()
            for t in self.auto.values():  # a try per tenant: one tenant's failure stops no other's round
                if self._stop.is_set():
                    return
                try:
                    await self.round(t, time.time())
                except Exception as exc:  # never let the task die: the next round tries again
                    at = time.monotonic()
                    if at - failing.get(t.name, -math.inf) >= LOG_EVERY_S:
                        failing[t.name] = at
                        log.warning(
                            "keep-alive round of %s failed (%s: %s); its entries are not kept until a round succeeds"
                            " (logged at most every %.0f s)",
                            t.name,
                            type(exc).__name__,
                            exc,
                            LOG_EVERY_S,
                            exc_info=not isinstance(exc, StoreUnavailable),  # Redis down or refusing: no traceback
                        )
                else:
                    if failing.pop(t.name, None) is not None:
                        log.warning("keep-alive: the rounds of %s succeed again", t.name)

    async def round(self, t: Tenant, now: float) -> list[tuple[DueEntry, Decision, int]]:
        """Decide ``t``'s entries that expire within two rounds (and half their TTL) of ``now``: (entry, decision,
        applied) for each, where applied is ``EntryReuse.apply``'s answer. Kept entries are billed, and re-pinned in the
        background. A stopping replica decides no further entry, and one decision in progress is applied and
        billed whole (a cancelled round never leaves an entry extended but not billed)."""
        out = []
        for entry in await self.store.due(t.name, now + 2 * self.period_s):
            if self._stop.is_set():
                break
            if entry.expires_ms / 1000 - now > entry.ttl_s / 2:  # decided at most half a TTL ahead: a keep is
                continue  # never decided again in the same round by another replica, nor bought ahead of time
            if entry.reuse is None or entry.tokens <= 0:
                decision = Decision(False, entry.expires_ms / 1000, "its reuse was forgotten")
            else:
                decision = decide(t.prices, entry.tokens, entry.ttl_s, entry.reuse, entry.expires_ms / 1000)
            applying = asyncio.get_running_loop().create_task(self._apply(t, entry, decision, now))
            self._applying.add(applying)
            applying.add_done_callback(self._applied)
            applied = await asyncio.shield(applying)
            out.append((entry, decision, applied))
        return out

    def _applied(self, task: asyncio.Task) -> None:
        self._applying.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the round awaiting it raises it (unless the round was cancelled, closing)

    async def _apply(self, t: Tenant, entry: DueEntry, decision: Decision, now: float) -> int:
        """Apply one decision and, when it is applied, count it, bill a keep and start its re-pin."""
        kept_s = max(0.0, decision.until - entry.expires_ms / 1000) if decision.keep else 0.0
        applied = await self.store.apply(entry, decision, now, round(entry.tokens * kept_s))
        if applied == 0:  # another replica (or a request) got there first
            return applied
        c = self.counters[t.name]
        if decision.keep and applied == 1:
            c.keep.inc()
            cost = hold_cost(t.prices, entry.tokens, kept_s, entry.ttl_s)
            c.kept.inc(round(entry.tokens * kept_s))
            c.cost.inc(dollars(cost))
            self.gw.ledger.record(t.name, storage_token_seconds=round(entry.tokens * kept_s), cost_pusd=cost)
            self.gw.spawn(self._repin(t, entry, decision.until - now))  # a busy group holds no round up
        else:
            c.drop.inc()
        return applied

    async def _repin(self, t: Tenant, entry: DueEntry, ttl_s: float) -> None:
        """Pin the entry's blocks on a group for ``ttl_s`` more, by the request a hit on it sends (its tokens, with
        its TTL; one output token, not billed: its kept time is)."""
        from common.sampling import SamplingParams
        from router.gateway.core import last, no_account

        try:
            tokens = await self.store.tokens(entry)
            if not tokens:
                return
            params = SamplingParams(max_tokens=1, temperature=0.0)
            run = self.gw.generate(t, tokens, params, "anthropic", len(tokens), max(1.0, ttl_s), no_account)
            await asyncio.wait_for(last(run), REPIN_TIMEOUT_S)
        except Exception as exc:  # the Redis entry stays: its next use reads what the group still holds
            log.warning("keep-alive: could not re-pin an entry of %s (%s: %s)", t.name, type(exc).__name__, exc)


class AdminSeries:
    """Every tenant's keep-alive counters from Redis (all replicas' decisions) for ``GET /admin/v1/metrics``:
    ``kvgrid_tenant_keep_alive_decisions_total{decision}``, ``kvgrid_tenant_keep_alive_kept_token_seconds_total``."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def __call__(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        rows: list[tuple[str, dict[str, int]]] = []
        try:
            for name in self.gw.tenants:
                rows.append((name, await self.gw.keep_alive.store.counters(name)))
        except StoreUnavailable:
            rows = []
        registry = CollectorRegistry()
        registry.register(_AdminCollector(rows))
        return generate_latest(registry)


class _AdminCollector:
    def __init__(self, rows: list[tuple[str, dict[str, int]]]) -> None:
        self.rows = rows

    def collect(self):
        decisions = CounterMetricFamily(
            "kvgrid_tenant_keep_alive_decisions", "Keep-alive decisions (every replica)", labels=["tenant", "decision"]
        )
        kept = CounterMetricFamily(
            "kvgrid_tenant_keep_alive_kept_token_seconds", "Token-seconds kept past their TTL", labels=["tenant"]
        )
        for tenant, c in self.rows:
            decisions.add_metric([tenant, "keep"], c["keep"])
            decisions.add_metric([tenant, "drop"], c["drop"])
            kept.add_metric([tenant], c["kept_token_seconds"])
        yield decisions
        yield kept


# -- the replay: ``kvgrid bench keep-alive`` -----------------------------------------------------------------------

POLICIES = ("never", "always", "auto")


@dataclass
class Entry:
    """One explicit entry of a replayed workload: its tokens, TTL and use times (seconds, sorted)."""

    pattern: str
    tokens: int
    ttl_s: float
    uses: list[float] = field(default_factory=list)


def sparse_workload(
    seed: int, entries: int = 2000, horizon_s: float = 86400.0, ttl_s: float = 300.0
) -> tuple[list[Entry], float]:
    """A seeded sparse workload over ``horizon_s``: hot entries (30%: sessions of 30 min to 4 h, reused every
    2 to 8 minutes on average), cold ones (50%: used once, half of them again 2 to 12 h later) and bursty ones
    (20%: 2 to 5 bursts hours apart, each of 3 to 10 uses seconds apart); prefixes of 1k to 16k tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(entries):
        tokens = rng.choice((1024, 2048, 4096, 8192, 16384))
        kind = rng.choices(("hot", "cold", "bursty"), (0.3, 0.5, 0.2))[0]
        e = Entry(kind, tokens, ttl_s)
        if kind == "hot":
            t = rng.uniform(0, horizon_s * 0.85)
            end = min(horizon_s, t + rng.uniform(1800, 4 * 3600))
            mean = rng.uniform(120, 480)
            while t < end:
                e.uses.append(t)
                t += rng.expovariate(1 / mean)
        elif kind == "cold":
            t = rng.uniform(0, horizon_s * 0.5)
            e.uses.append(t)
            if rng.random() < 0.5:
                e.uses.append(t + rng.uniform(2 * 3600, 12 * 3600))
        else:
            t = rng.uniform(0, horizon_s * 0.3)
            for _ in range(rng.randint(2, 5)):
                for _ in range(rng.randint(3, 10)):
                    e.uses.append(t)
                    t += rng.uniform(5, 60)
                t += rng.uniform(3600, 6 * 3600)
        e.uses = sorted(u for u in e.uses if u < horizon_s)
        if e.uses:
            out.append(e)
    return out, horizon_s


def replay_entry(prices: Prices, e: Entry, policy: str, horizon_s: float) -> int:
    """What entry ``e``'s uses cost under ``policy`` (pico-dollars): each use reads the entry when it is alive
    (``cache_read``; a read refreshes its TTL) or writes it again (the write price and its TTL of storage);
    ``always`` holds it from its first write to the horizon, ``auto`` as ``decide`` says (decided at each
    expiry), ``never`` lets it expire. Only the entry's own tokens are priced (the rest of each prompt costs the
    same under every policy)."""
    n, ttl = e.tokens, e.ttl_s
    write = n * prices.write_price(ttl) + keep_cost(prices, n, ttl)
    cost, expires = 0, -math.inf
    reuse: Reuse | None = None

    def hold_until(t: float) -> None:  # auto's decisions at each expiry before t
        nonlocal cost, expires
        while reuse is not None and expires < t:
            d = decide(prices, n, ttl, reuse, expires)
            if not d.keep:
                return
            cost += hold_cost(prices, n, d.until - expires, ttl)
            expires = d.until

    for t in e.uses:
        if policy == "auto":
            hold_until(t)
        elif policy == "always" and reuse is not None and expires < t:
            cost += hold_cost(prices, n, t - expires, ttl)
            expires = t
        hit = t <= expires
        cost += n * prices.cache_read if hit else write
        expires = max(expires, t + ttl) if hit else t + ttl
        reuse = Reuse(t) if reuse is None else reuse.used(t, hit)
    if policy == "auto":
        hold_until(math.inf)
    elif policy == "always" and expires < horizon_s:
        cost += hold_cost(prices, n, horizon_s - expires, ttl)
    return cost


def replay(prices: Prices, workload: list[Entry], horizon_s: float) -> dict[str, dict[str, int]]:
    """Cost per policy, in total and per reuse pattern (pico-dollars)."""
    out: dict[str, dict[str, int]] = {p: {"total": 0} for p in POLICIES}
    for e in workload:
        for p in POLICIES:
            c = replay_entry(prices, e, p, horizon_s)
            out[p]["total"] += c
            out[p][e.pattern] = out[p].get(e.pattern, 0) + c
    return out


def bench(
    seeds: Sequence[int] = (0, 1, 2),
    entries: int = 2000,
    hours: float = 24.0,
    ttl_s: float = 300.0,
    presets: Sequence[str] = tuple(PRESETS),
) -> list[dict[str, Any]]:
    """``kvgrid bench keep-alive``: the replay of each seeded workload at each preset's prices."""
    results = []
    for preset in presets:
        prices = Prices.from_config(PricesConfig.model_validate({"preset": preset}))  # a preset's name, checked
        for seed in seeds:
            workload, horizon = sparse_workload(seed, entries, hours * 3600, ttl_s)
            costs = replay(prices, workload, horizon)
            totals = {p: costs[p]["total"] for p in POLICIES}
            results.append(
                {
                    "preset": preset,
                    "seed": seed,
                    "entries": len(workload),
                    "uses": sum(len(e.uses) for e in workload),
                    "ttl_s": ttl_s,
                    "cost_usd": {p: dollars(v) for p, v in totals.items()},
                    "by_pattern_usd": {
                        p: {k: dollars(v) for k, v in costs[p].items() if k != "total"} for p in POLICIES
                    },
                    "auto_over_best": totals["auto"] / max(1, min(totals["never"], totals["always"])),
                    "auto_at_most_best": totals["auto"] <= min(totals["never"], totals["always"]),
                }
            )
    return results


def print_bench(results: list[dict[str, Any]]) -> None:
    print(f"{'preset':<10}{'seed':>5}{'entries':>9}{'uses':>8}{'never $':>12}{'always $':>12}{'auto $':>12}  auto/best")
    for r in results:
        c = r["cost_usd"]
        print(
            f"{r['preset']:<10}{r['seed']:>5}{r['entries']:>9}{r['uses']:>8}{c['never']:>12.2f}{c['always']:>12.2f}"
            f"{c['auto']:>12.2f}  {r['auto_over_best']:.3f}{'' if r['auto_at_most_best'] else '  (over the best!)'}"
        )
    print("\nby reuse pattern, all seeds ($ never / always / auto):")
    for preset in dict.fromkeys(r["preset"] for r in results):
        rows = [r for r in results if r["preset"] == preset]
        cells = []
        for pattern in ("hot", "cold", "bursty"):
            c = [sum(r["by_pattern_usd"][p].get(pattern, 0.0) for r in rows) for p in POLICIES]
            cells.append(f"{pattern} {c[0]:.2f} / {c[1]:.2f} / {c[2]:.2f}")
        print(f"{preset:<10}" + "   ".join(cells))
