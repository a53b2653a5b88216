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

from dataclasses import dataclass, fields
from typing import Any

from common.config import PRICE_FIELDS, PricesConfig

PICO = 10**12  # pico-dollars in a dollar
SHORT_TTL_S = 300.0  # an entry living at most this long is written at the 5-minute price

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
