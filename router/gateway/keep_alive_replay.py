"""``kvgrid bench keep-alive``: seeded sparse workloads (hot, cold and bursty entries) replayed under each
keep-alive policy (never, always, ``auto``: ``economics.decide``) at each preset's prices."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.config import PricesConfig
from common.defaults import DEFAULT_PIN_TTL_S
from router.gateway.economics import PRESETS, Prices, Reuse, decide, dollars, hold_cost, keep_cost

POLICIES = ("never", "always", "auto")


@dataclass
class Entry:
    """One explicit entry of a replayed workload: its tokens, TTL and use times (seconds, sorted)."""

    pattern: str
    tokens: int
    ttl_s: float
    uses: list[float] = field(default_factory=list)


def sparse_workload(
    seed: int, entries: int = 2000, horizon_s: float = 86400.0, ttl_s: float = DEFAULT_PIN_TTL_S
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
    ttl_s: float = DEFAULT_PIN_TTL_S,
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
