"""Keep-alive of explicit cache entries: per tenant ``keep_alive: off | auto``.

With ``auto`` the gateway keeps a ``cache_control`` entry warm past its TTL only while the entry's observed reuse
makes rebuilding it cost more than keeping it, at the tenant's prices: the rule is ``economics.decide`` (the cost
of keeping against the cost of rebuilding, router/gateway/economics.py). Each entry's reuse (its last use, the gaps
between its last ``HISTORY`` uses, uses and hits) is kept in Redis next to the entry (``EntryReuse``,
router/gateway/keep_alive_store.py), so every gateway replica decides the same; a background task of every replica
(``KeepAlive``) decides, shortly before an entry expires, whether to extend it by one more TTL. A keep extends the
Redis entry and re-pins its blocks on a group by the same request a hit sends (the entry's tokens and TTL, as
cached contents are pinned), and the time kept is billed as storage in the usage ledger
(``storage_token_seconds``, ``cost_pusd``: ``GET /{tenant}/v1/usage``). Each decision is a compare-and-set on the
entry's expiry in Redis: of replicas deciding the same entry in the same round, one wins, so an entry is never
extended (or billed) twice. ``kvgrid bench keep-alive`` replays workloads under the rule
(router/gateway/keep_alive_replay.py).

Cached contents (``/v1/cachedContents``, the Gemini API) are not kept alive: their lifetime is the one the user
chose (``ttl`` / ``expireTime``) and changes only when the user updates it."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Protocol

import redis.asyncio
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily

from common import env
from common.config import TenantConfig
from router.gateway.economics import (  # noqa: F401  (re-exported: the rule, where it was)
    HISTORY,
    MARGIN,
    Decision,
    Prices,
    Reuse,
    decide,
    dollars,
    hold_cost,
    hold_rate,
    keep_budget,
    never_keeps,
    rebuild_premium,
)
from router.gateway.keep_alive_replay import (  # noqa: F401  (re-exported)
    POLICIES,
    Entry,
    bench,
    print_bench,
    replay,
    replay_entry,
    sparse_workload,
)
from router.gateway.keep_alive_store import (  # noqa: F401  (re-exported)
    ENTRY_PREFIX,
    ROUND_BATCH,
    STATS_LIFE_S,
    TOKENS_SLACK_S,
    DueEntry,
    EntryReuse,
)
from router.gateway.store import StoreUnavailable, UsageLedger

log = logging.getLogger(__name__)

MAX_PERIOD_S = 2.0  # the background task's round, at most...
MIN_PERIOD_S = 0.05
PERIOD_ENV = env.KEEP_ALIVE_PERIOD_S.name  # ...or exactly this (a test's or an operator's override)
REPIN_TIMEOUT_S = 60.0
CLOSE_S = 2.0  # a stopping replica waits this long for a round in progress
LOG_EVERY_S = 60.0  # a tenant whose rounds keep failing is logged at most this often


class _KeptMetrics(Protocol):
    @property
    def registry(self) -> CollectorRegistry: ...

    @property
    def model_name(self) -> str: ...


class KeptTenant(Protocol):
    """What the keep-alive service uses of a gateway's tenant (router/gateway/tenants.py ``Tenant``)."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> TenantConfig: ...

    @property
    def prices(self) -> Prices: ...

    @property
    def metrics(self) -> _KeptMetrics: ...


class _TenantCounters:
    """A tenant's keep-alive series on its own metrics (``GET /{tenant}/metrics``: this replica's decisions, merged
    there with every other replica's), labelled like the rest of them (``tenant``, ``model_name``)."""

    def __init__(self, t: KeptTenant) -> None:
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
    return env.keep_alive_period_s()


class KeepAlive:
    """One gateway replica's keep-alive: it notes every use of an explicit entry of a tenant with
    ``keep_alive: auto`` (``used``) and, every round (``period_s``: a quarter of the shortest TTL noted, at most
    ``MAX_PERIOD_S``, or ``$KVGRID_KEEP_ALIVE_PERIOD_S``), decides the entries that expire within two rounds.

    It is given what it uses of the gateway: its Redis client, its tenants, ``spawn`` (run a coroutine in the
    background), the usage ``ledger`` a keep is billed to, and ``repin`` (pin a tenant's tokens on a group for
    so many seconds, by the request a hit on them sends)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        tenants: Mapping[str, KeptTenant],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
        ledger: UsageLedger,
        repin: Callable[[Any, list[int], float], Awaitable[object]],
    ) -> None:
        self.spawn, self.ledger, self.repin = spawn, ledger, repin
        self.store = EntryReuse(client)
        self.auto: dict[str, KeptTenant] = {}
        self.counters: dict[str, _TenantCounters] = {}
        self.fixed_period_s = period_from_env()
        self.period_s = self.fixed_period_s or MAX_PERIOD_S
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._closed = False
        self._applying: set[asyncio.Task] = set()  # decisions being applied (shielded from a round's cancelling)
        for t in tenants.values():
            self.set_tenant(t)

    def set_tenant(self, t: KeptTenant) -> None:
        """A tenant added or changed: its keep-alive series, and whether its entries are kept (``auto``)."""
        if t.name not in self.counters:
            self.counters[t.name] = _TenantCounters(t)
        if t.config.keep_alive != "auto":
            self.auto.pop(t.name, None)
            return
        self.auto[t.name] = t
        if (why := never_keeps(t.prices)) is not None:
            log.warning("tenant %s has keep_alive: auto, but no entry of it is ever kept: %s", t.name, why)
        self.start()

    def drop_tenant(self, name: str) -> None:
        """A tenant deleted: none of its entries is kept from now on."""
        self.auto.pop(name, None)
        self.counters.pop(name, None)

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
        t: KeptTenant,
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
            self.spawn(self.store.note_use(t.name, key, prompt[:pos], ttl_at[pos], left is not None, now))
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

    async def round(self, t: KeptTenant, now: float) -> list[tuple[DueEntry, Decision, int]]:
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

    async def _apply(self, t: KeptTenant, entry: DueEntry, decision: Decision, now: float) -> int:
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
            self.ledger.record(t.name, storage_token_seconds=round(entry.tokens * kept_s), cost_pusd=cost)
            self.spawn(self._repin(t, entry, decision.until - now))  # a busy group holds no round up
        else:
            c.drop.inc()
        return applied

    async def _repin(self, t: KeptTenant, entry: DueEntry, ttl_s: float) -> None:
        """Pin the entry's blocks on a group for ``ttl_s`` more, by the request a hit on it sends (its tokens, with
        its TTL; one output token, not billed: its kept time is)."""
        try:
            tokens = await self.store.tokens(entry)
            if not tokens:
                return
            await asyncio.wait_for(self.repin(t, tokens, max(1.0, ttl_s)), REPIN_TIMEOUT_S)
        except Exception as exc:  # the Redis entry stays: its next use reads what the group still holds
            log.warning("keep-alive: could not re-pin an entry of %s (%s: %s)", t.name, type(exc).__name__, exc)


class AdminSeries:
    """Every tenant's keep-alive counters from Redis (all replicas' decisions) for ``GET /admin/v1/metrics``:
    ``kvgrid_tenant_keep_alive_decisions_total{decision}``, ``kvgrid_tenant_keep_alive_kept_token_seconds_total``."""

    def __init__(self, tenants: Iterable[str], store: EntryReuse) -> None:
        self.tenants, self.store = list(tenants), store

    async def __call__(self) -> bytes:
        from prometheus_client import generate_latest

        rows: list[tuple[str, dict[str, int]]] = []
        try:
            for name in self.tenants:
                rows.append((name, await self.store.counters(name)))
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
