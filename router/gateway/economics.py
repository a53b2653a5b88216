"""Prompt-cache economics: a tenant's price table (``prices:`` in its config, a vendor preset plus overrides),
what one request costs, and what the same request would have cost without the cache.

Money is integer pico-dollars (1e-12 $) throughout: a price of $X per million tokens is X * 1e6 pico-dollars per
token, an integer for any price with at most 6 decimals, so every cost is an exact integer sum and the usage
ledger's Redis counters (HINCRBY) stay exact (router/gateway/store.py ``UsageLedger``). Storage, billed per
token-hour, is recorded in token-seconds; its cost is the one rounded figure (to the nearest pico-dollar, per
recorded entry).

What is billed how:

- uncached prompt tokens (neither read from the cache nor written to an entry): ``input``;
- tokens read from the cache (the reuse reported to the tenant): ``cache_read``;
- tokens written to an explicit entry (``cache_control`` prefix, cached content): ``cache_write_5m`` when the
  entry's TTL is at most 5 minutes, else ``cache_write_1h``; plus ``storage`` for each token-hour of that TTL;
- output tokens: ``output``.

Without the cache, every prompt token would have been ``input`` and nothing written or stored: the savings are
the difference (negative when writes were never read back)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from common.config import PRICE_FIELDS, PricesConfig
from common.defaults import FIVE_MINUTES_S

PICO = 10**12  # pico-dollars in a dollar
SHORT_TTL_S = FIVE_MINUTES_S  # an entry living at most this long is written at the 5-minute price

# Public list prices, dollars per million tokens (storage: per million token-hours), as the vendors' pricing pages
# gave them when these presets were written (2026); figures only. A write where the vendor has no write fee is the
# input price (the tokens are billed once, as input).
PRESETS: dict[str, dict[str, float]] = {
    # OpenAI GPT-4o, https://openai.com/api/pricing/ : input $2.50, cached input $1.25, output $10.00.
    "openai": {
        "input": 2.50,
        "output": 10.00,
        "cache_write_5m": 2.50,
        "cache_write_1h": 2.50,
        "cache_read": 1.25,
        "storage": 0.0,
    },
    # Anthropic Claude Sonnet 4, https://docs.anthropic.com/en/docs/about-claude/pricing : base input $3, 5-minute
    # cache writes $3.75, 1-hour cache writes $6, cache hits and refreshes $0.30, output $15.
    "anthropic": {
        "input": 3.00,
        "output": 15.00,
        "cache_write_5m": 3.75,
        "cache_write_1h": 6.00,
        "cache_read": 0.30,
        "storage": 0.0,
    },
    # Google Gemini 2.5 Pro (prompts <= 200k tokens), https://ai.google.dev/gemini-api/docs/pricing : input $1.25,
    # output $10.00, context caching $0.125, storage $4.50 per million tokens per hour.
    "gemini": {
        "input": 1.25,
        "output": 10.00,
        "cache_write_5m": 1.25,
        "cache_write_1h": 1.25,
        "cache_read": 0.125,
        "storage": 4.50,
    },
    # DeepSeek deepseek-chat (V3.2), https://api-docs.deepseek.com/quick_start/pricing : input cache hit $0.028,
    # cache miss $0.28, output $0.42.
    "deepseek": {
        "input": 0.28,
        "output": 0.42,
        "cache_write_5m": 0.28,
        "cache_write_1h": 0.28,
        "cache_read": 0.028,
        "storage": 0.0,
    },
}


def _pico(dollars_per_million: float) -> int:
    return round(dollars_per_million * 1e6)


@dataclass(frozen=True)
class Prices:
    """A resolved price table in integer pico-dollars per token (``storage``: per token-hour)."""

    input: int = 0
    output: int = 0
    cache_write_5m: int = 0
    cache_write_1h: int = 0
    cache_read: int = 0
    storage: int = 0
    preset: str | None = None

    @classmethod
    def from_config(cls, config: PricesConfig | None) -> Prices:
        """The table of a tenant's ``prices:`` (None: everything 0): the preset's figures, each overridden by the
        field given."""
        if config is None:
            return cls()
        base = PRESETS.get(config.preset or "", {})
        values = {}
        for f in PRICE_FIELDS:
            given = getattr(config, f)
            values[f] = _pico(given if given is not None else base.get(f, 0.0))
        return cls(**values, preset=config.preset)

    @property
    def priced(self) -> bool:
        return any(getattr(self, f) for f in PRICE_FIELDS)

    def public(self) -> dict[str, Any]:
        """The table as configured: dollars per million tokens (storage per million token-hours)."""
        return {"preset": self.preset, **{f: getattr(self, f) / 1e6 for f in PRICE_FIELDS}}

    def write_price(self, ttl_s: float) -> int:
        return self.cache_write_5m if ttl_s <= SHORT_TTL_S else self.cache_write_1h


@dataclass(frozen=True)
class RequestCost:
    """One request's billable quantities and money (pico-dollars), as the ledger records them."""

    cache_write_5m_tokens: int
    cache_write_1h_tokens: int
    storage_token_seconds: int
    cost: int  # what it costs with the cache
    uncached_cost: int  # the same prompt and output without any cache

    def ledger_fields(self) -> dict[str, int]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith(("_tokens", "_seconds"))}
        out["cost_pusd"], out["uncached_cost_pusd"] = self.cost, self.uncached_cost
        return out


def storage_cost(prices: Prices, token_seconds: int) -> int:
    """Pico-dollars of ``token_seconds`` of storage (rounded half up to a pico-dollar)."""
    return (prices.storage * token_seconds + 1800) // 3600


def request_cost(
    prices: Prices,
    prompt: int,
    read: int,
    write: int,
    output: int,
    write_ttl_s: float = SHORT_TTL_S,
    segments: list[tuple[int, float]] | None = None,
) -> RequestCost:
    """The cost of a request of ``prompt`` tokens of which ``read`` came from the cache and ``write`` were written
    to an explicit entry living ``write_ttl_s`` (or, with ``segments``, in runs of (tokens, TTL): an Anthropic
    request's breakpoints may have different TTLs), and ``output`` tokens generated."""
    read, write = max(0, min(read, prompt)), max(0, write)
    write = min(write, prompt - read)
    fresh = prompt - read - write
    runs = _runs(segments, write) if segments is not None else [(write, write_ttl_s)]
    long = sum(k for k, ttl in runs if ttl > SHORT_TTL_S)
    storage_s = sum(round(k * ttl) for k, ttl in runs if k)
    cost = (
        fresh * prices.input
        + read * prices.cache_read
        + sum(k * prices.write_price(ttl) for k, ttl in runs)
        + output * prices.output
        + storage_cost(prices, storage_s)
    )
    uncached = prompt * prices.input + output * prices.output
    return RequestCost(
        cache_write_5m_tokens=write - long,
        cache_write_1h_tokens=long,
        storage_token_seconds=storage_s,
        cost=cost,
        uncached_cost=uncached,
    )


def _runs(segments: list[tuple[int, float]], write: int) -> list[tuple[int, float]]:
    """``segments`` cut (from the end) or padded (at the last TTL) to exactly ``write`` tokens."""
    out, left = [], write
    for k, ttl in segments:
        take = min(max(0, k), left)
        if take:
            out.append((take, ttl))
        left -= take
    if left:
        out.append((left, segments[-1][1] if segments else SHORT_TTL_S))
    return out


def keep_cost(prices: Prices, tokens: int, seconds: float) -> int:
    """What keeping ``tokens`` stored ``seconds`` longer costs (pico-dollars): the storage price, the figure a
    keep-alive decision weighs against rebuilding (``rebuild_cost``)."""
    return storage_cost(prices, round(tokens * seconds))


def rebuild_cost(prices: Prices, tokens: int, ttl_s: float = SHORT_TTL_S) -> int:
    """What writing ``tokens`` to an entry again costs, over reading them (pico-dollars)."""
    return tokens * (prices.write_price(ttl_s) - prices.cache_read)


def dollars(pico: int) -> float:
    return pico / PICO


def summary(tenant: str, prices: Prices, totals: dict[str, int]) -> dict[str, Any]:
    """``GET /{tenant}/v1/usage``'s answer from the ledger's ``totals``: the counters, the cost, the cost without the
    cache and the savings (dollars, and exact pico-dollars)."""
    cost, uncached = totals.get("cost_pusd", 0), totals.get("uncached_cost_pusd", 0)
    prompt = totals.get("prompt_tokens", 0)
    usage = {k: v for k, v in totals.items() if not k.endswith("_pusd")}
    return {
        "tenant": tenant,
        "prices": prices.public() if prices.priced or prices.preset else None,
        "usage": usage,
        "cache_read_share": round(totals.get("cached_tokens", 0) / prompt, 6) if prompt else 0.0,
        "cost_usd": dollars(cost),
        "cost_without_cache_usd": dollars(uncached),
        "savings_usd": dollars(uncached - cost),
        "savings_share": round((uncached - cost) / uncached, 6) if uncached else 0.0,
        "cost_picodollars": cost,
        "cost_without_cache_picodollars": uncached,
    }


# -- keeping an explicit entry alive past its TTL: the rule (router/gateway/keep_alive.py applies it) -------------
#
# Keeping an entry of ``T`` tokens costs its storage (``storage`` per token-hour) for the time kept; for prices
# without storage (Anthropic bills none: an entry is held by refreshing it) holding it costs what the vendor charges
# to hold it, one refresh (a read of its ``T`` tokens at ``cache_read``) per TTL, pro rata (``hold_cost``).
# Rebuilding it costs the write price over the read price of its tokens (``rebuild_cost``) plus the storage a new
# write is billed for its TTL (``rebuild_premium``). ``decide`` is a pure function, the same in the gateway and in
# ``kvgrid bench keep-alive``'s replay.

HISTORY = 8  # the gaps between an entry's last uses that its reuse keeps
MARGIN = 2.0  # an entry is expected back within this many times its longest recent gap


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
    reading (``rebuild_cost``) and the storage a new write is billed for its TTL."""
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
