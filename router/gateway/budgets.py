"""Tenants' spending budgets (``Budgets``): dollars at the tenant's prices over a period (daily, monthly, total).
Admission reserves a request's worst-case cost in Redis with one Lua script (spent + reserved + this <= hard, else
429); the request's end settles it (the reservation released, the real cost added). Reservations expire, so a
crashed replica's stop counting. Overspend is bounded by what was in flight past the hard limit: nothing, since a
request's real cost never exceeds its reserved worst case. Keys carry a scope: the tenant's name now,
``tenant/key-id`` for per-key budgets."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

import redis.asyncio as aioredis

from common.tenant_config import BudgetConfig
from router.gateway.economics import Prices, storage_cost
from router.gateway.errors import err
from router.gateway.tenant_registry import KeyRecord
from router.gateway.tenants import Slot, key_scope

log = logging.getLogger(__name__)

MICRO = 1_000_000  # pico-dollars per micro-dollar: Redis keeps integer micro-dollars (exact in Lua's doubles)
RESERVATION_TTL_S = 3600.0  # a reservation not settled by then (its replica crashed) no longer counts

# KEYS: spent counter, reservations zset (member "id:micro", score expiry). ARGV: now, hard (micro, -1 none),
# amount (micro), member, expiry, key ttl. Returns {ok, spent, reserved}.
_RESERVE = """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
local spent = tonumber(redis.call('GET', KEYS[1]) or '0')
local reserved = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  reserved = reserved + tonumber(string.match(m, ':(%d+)$'))
end
local hard, amount = tonumber(ARGV[2]), tonumber(ARGV[3])
if hard >= 0 and spent + reserved + amount > hard then
  return {0, spent, reserved}
end
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return {1, spent, reserved + amount}
"""

# KEYS: spent counter, reservations zset. ARGV: member, cost (micro), key ttl (0: none). Returns the new spent.
_SETTLE = """
redis.call('ZREM', KEYS[2], ARGV[1])
local spent = redis.call('INCRBY', KEYS[1], ARGV[2])
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return spent
"""


def period_bounds(period: str, now: float) -> tuple[str, datetime | None]:
    """The period's id (part of its Redis keys) and when it resets (UTC; None for ``total``)."""
    d = datetime.fromtimestamp(now, UTC)
    if period == "daily":
        start = d.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.strftime("%Y-%m-%d"), datetime.fromtimestamp(start.timestamp() + 86400, UTC)
    if period == "monthly":
        nxt = datetime(d.year + d.month // 12, d.month % 12 + 1, 1, tzinfo=UTC)
        return d.strftime("%Y-%m"), nxt
    return "total", None


def worst_case_cost(prices: Prices, prompt: int, max_out: int, write: int = 0, write_ttl_s: float = 0.0) -> int:
    """An upper bound of a request's cost (pico-dollars, as ``request_cost``): every prompt token at the dearest of
    the input, cache-read and write prices, all ``max_out`` output tokens, the storage of ``write`` written ones."""
    per_token = max(prices.input, prices.cache_read, prices.write_price(write_ttl_s) if write else 0)
    return prompt * per_token + max_out * prices.output + storage_cost(prices, round(max(0, write) * write_ttl_s))


def to_micro(pico: int) -> int:
    """Pico-dollars to the micro-dollars kept in Redis, rounded up (a reservation stays an upper bound, and the
    real cost, rounded the same way, never exceeds it)."""
    return -(-max(0, pico) // MICRO)


@dataclass
class Reservation:
    """A request's reserved worst case in ``scope``'s period ``period_id``; ``settle`` ends it."""

    scope: str
    period_id: str
    member: str
    key_ttl: int


@dataclass
class BudgetState:
    """A budget's figures now, for ``/v1/usage``."""

    period: str
    spent_usd: float
    reserved_usd: float
    hard_usd: float | None
    soft_usd: float | None
    resets_at: str | None

    def public(self) -> dict:
        left = None if self.hard_usd is None else max(0.0, self.hard_usd - self.spent_usd - self.reserved_usd)
        return {
            "period": self.period,
            "spent_usd": round(self.spent_usd, 6),
            "reserved_usd": round(self.reserved_usd, 6),
            "soft_usd": self.soft_usd,
            "hard_usd": self.hard_usd,
            "left_usd": None if left is None else round(left, 6),
            "resets_at": self.resets_at,
        }


class BudgetExceeded(Exception):
    """Refused by the hard budget: ``message`` says which budget, what is spent and when it resets."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Budgets:
    """Every scope's budget (``set_budget``), enforced in Redis over all replicas; ``clock`` is settable in tests."""

    def __init__(self, client: aioredis.Redis, clock: Callable[[], float] = time.time) -> None:
        self.redis, self.clock = client, clock
        self.budgets: dict[str, BudgetConfig] = {}
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._soft_logged: dict[str, str] = {}  # scope -> the period its soft alert was logged in
        self.on_spent: Callable[[str, float, bool], None] | None = None  # (scope, spent, soft exceeded): metrics
        self.spawn: Callable[[Coroutine[Any, Any, Any]], Any] = asyncio.ensure_future  # the gateway's background

    def set_budget(self, scope: str, budget: BudgetConfig | None) -> None:
        """Replace ``scope``'s budget at run time (None: unlimited); what is spent this period stays."""
        if budget is None:
            self.budgets.pop(scope, None)
        else:
            self.budgets[scope] = budget

    @staticmethod
    def _keys(scope: str, period_id: str) -> list[str]:
        base = f"kvgrid:budget:{{{scope}}}:{period_id}"
        return [base + ":spent", base + ":reserved"]

    def _period(self, b: BudgetConfig) -> tuple[str, datetime | None, int]:
        pid, resets = period_bounds(b.period, self.clock())
        ttl = 0 if resets is None else int(resets.timestamp() - self.clock()) + 86400 * 2
        return pid, resets, ttl

    async def reserve(self, scope: str, pico: int) -> Reservation | None:
        """Reserve ``pico`` pico-dollars against ``scope``'s budget (None without one); past hard ``BudgetExceeded``."""
        b = self.budgets.get(scope)
        if b is None:
            return None
        pid, resets, ttl = self._period(b)
        now = self.clock()
        hard = -1 if b.hard_usd is None else round(b.hard_usd * MICRO)
        amount = to_micro(pico)
        member = f"{uuid.uuid4().hex}:{amount}"
        ok, spent, reserved = await self._reserve(
            keys=self._keys(scope, pid),
            args=[now, hard, amount, member, now + RESERVATION_TTL_S, int(RESERVATION_TTL_S) + max(ttl, 0)],
        )
        if not ok:
            when = resets.isoformat() if resets is not None else "never (a total budget)"
            raise BudgetExceeded(
                f"{b.period} budget of {b.hard_usd:.2f} USD (budget.hard_usd) is spent: {spent / MICRO:.6f} "
                f"USD spent and {reserved / MICRO:.6f} USD in flight this period; it resets at {when}"
            )
        return Reservation(scope, pid, member, ttl)

    async def settle(self, res: Reservation | None, pico: int) -> None:
        """Release ``res`` and add the request's real cost; the soft alert is raised once a period."""
        if res is None:
            return
        spent = await self._settle(
            keys=self._keys(res.scope, res.period_id),
            args=[res.member, to_micro(pico), res.key_ttl],
        )
        self._soft(res.scope, res.period_id, int(spent) / MICRO)

    async def release(self, res: Reservation | None) -> None:
        """A request that ended before it cost anything: its reservation released."""
        await self.settle(res, 0)

    def _soft(self, scope: str, period_id: str, spent: float) -> None:
        b = self.budgets.get(scope)
        over = b is not None and b.soft_usd is not None and spent > b.soft_usd
        if over and b is not None and self._soft_logged.get(scope) != period_id:
            self._soft_logged[scope] = period_id
            log.warning("budget of %s: %.6f USD spent passes its soft budget of %s USD", scope, spent, b.soft_usd)
        if self.on_spent is not None:
            self.on_spent(scope, spent, over)

    async def state(self, scope: str) -> BudgetState | None:
        """``scope``'s budget now (None without one): spent, live reservations, limits, the next reset."""
        b = self.budgets.get(scope)
        if b is None:
            return None
        pid, resets, _ = self._period(b)
        spent_key, res_key = self._keys(scope, pid)
        spent = int(await self.redis.get(spent_key) or 0)
        members: list[Any] = list(await self.redis.zrangebyscore(res_key, self.clock(), "+inf"))
        reserved = sum(int(str(m.decode() if isinstance(m, bytes) else m).rsplit(":", 1)[1]) for m in members)
        return BudgetState(
            b.period,
            spent / MICRO,
            reserved / MICRO,
            b.hard_usd,
            b.soft_usd,
            None if resets is None else resets.isoformat(),
        )


class BudgetGate(Budgets):
    """The tenants' budgets at admission (``admit``: 429 in the API's format past hard); a request's reservation
    is settled at its real cost when its in-flight place (``Slot``) is released, however the request ended.
    ``set_budget(tenant name, budget)`` replaces one at run time."""

    async def admit(self, slot: Slot, prompt: int, max_out: int, api: str, write: int = 0, ttl_s: float = 0.0) -> None:
        """Reserve the request's worst case in its tenant's budget and in its API key's own (``slot.key.budget``);
        both must take it, else 429 naming the budget (and nothing stays reserved)."""
        t = slot.tenant
        scopes = [t.name] if t.name in self.budgets else []
        scope = self.key_budget(t.name, slot.key)
        if scope is not None:
            scopes.append(scope)
        if not scopes:
            return
        pico = worst_case_cost(t.prices, prompt, max_out, write, ttl_s)
        held: list[Reservation] = []
        try:
            for scope in scopes:
                res = await self.reserve(scope, pico)
                if res is not None:
                    held.append(res)
        except BudgetExceeded as exc:
            for res in held:
                self.spawn(self.release(res))
            t.metrics.budget_refusal()
            whose = "this API key's" if scope != t.name else "this tenant's"
            raise err(429, f"{whose} {exc.message}", api) from None
        for res in held:
            slot.on_release.append(partial(self._settle_at_cost, res))

    def key_budget(self, tenant: str, key: KeyRecord | None) -> str | None:
        """The scope of ``key``'s own budget, set as the registry holds it now (None: the key has none)."""
        if key is None or not key.budget:
            return None
        scope = key_scope(tenant, key.id)
        self.budgets[scope] = BudgetConfig.model_validate(key.budget)
        return scope

    def _settle_at_cost(self, res: Reservation, slot: Slot) -> None:
        """Settle ``res`` at what the request of ``slot`` cost (run when the slot is released)."""
        self.spawn(self.settle(res, slot.cost))
