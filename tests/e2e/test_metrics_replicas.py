"""Metrics that add up across gateway replicas (router/gateway/replica_metrics.py): the merge of counters,
histograms and gauges; a replica that disappears keeps its counts; and, against one real `kvgrid serve` with two
gateway replicas sharing the port, 20 scrapes in a row (a new connection each, so the kernel spreads them over the
replicas) all show every request, in the tenant's and the admin metrics, also while a replica is killed and
replaced."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import httpx
import psutil
import pytest
import redis
import redis.asyncio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.config import MonitoringConfig
from common.outputs import Timings
from harness import ACME_KEY, ADMIN_KEY, GLOBEX_KEY, TEST_DEFAULTS, TWO_TENANTS, free_port, serving, wait_for
from router.gateway.monitoring import Alert
from router.gateway.replica_metrics import (
    REPLICAS_KEY,
    Key,
    ReplicaMetrics,
    Source,
    decode,
    merge_gauges,
    render,
    take,
    tenant_extras,
)
from router.gateway.store import StoreUnavailable
from router.gateway.tenant_metrics import TenantMetrics

REQUESTS = 20
SCRAPES = 20


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    """A sample summed over the label sets that have ``labels``."""
    return sum(v for (n, lbl), v in samples.items() if n == name and set(labels.items()) <= set(lbl))


def _metrics(tenant: str = "acme", n: int = 0, cached: int = 0, drop: Alert | None = None) -> TenantMetrics:
    m = TenantMetrics(tenant, 16, MonitoringConfig(drop_alerts=False), model_name="demo")
    m.clock = lambda: 1000.0
    for _ in range(n):
        m.record(100, cached, 10, 0, cached)
    if drop is not None:
        m.last_alert = drop
        m._n["alert_active"].set(1)
        m._n["alert_block"].set(drop.block)
    return m


def _source(m: TenantMetrics) -> Source:
    return Source(m.registry, lambda: tenant_extras(m))


def _alert(at: float, block: int) -> Alert:
    return Alert("acme", at, 0.9, 0.1, block, block * 16)


# -- the merge (pure) ----------------------------------------------------------------------------------------------


def test_counters_and_histograms_are_summed_and_gauges_merged_by_their_rule():
    a = _metrics(n=3, cached=100, drop=_alert(50.0, 7))  # fully cached, an old alert
    b = _metrics(n=1, cached=0, drop=_alert(80.0, 21))  # nothing cached, the newest alert
    for m, seconds in ((a, [0.05, 0.05, 3.0]), (b, [0.05])):
        for s in seconds:
            m._n["ttft"].observe(s)
    # The engine's phases and the reuse per tier: a's 2 s queue, 60 reused of which 30 from host and 10 from disk.
    a.observe_group([Timings(scheduled=2.0, first_token=2.5, finished=4.0)], 60, 30, 10)
    b.observe_group([Timings(scheduled=0.01, first_token=0.02, finished=0.5)], 20, 50, 0)  # host capped at 20
    snaps = [take(m.registry, tenant_extras(m)) for m in (a, b)]
    counts: dict[Key, float] = {}
    for s in snaps:
        for k, v in s.counts.items():
            counts[k] = counts.get(k, 0.0) + v
    text = render(snaps[0], counts, merge_gauges([s.gauges for s in snaps], counts)).decode()
    got = _samples(text)
    lbl = {"tenant": "acme", "model_name": "demo"}
    assert _value(got, "kvgrid_requests_total", **lbl) == 4
    assert _value(got, "kvgrid_prompt_tokens_total", **lbl) == 400
    # Histograms: every bucket, the count and the sum added up.
    assert _value(got, "kvgrid_time_to_first_token_seconds_count", **lbl) == 4
    assert _value(got, "kvgrid_time_to_first_token_seconds_sum", **lbl) == pytest.approx(3.15)
    assert _value(got, "kvgrid_time_to_first_token_seconds_bucket", le="0.06", **lbl) == 3
    assert _value(got, "kvgrid_time_to_first_token_seconds_bucket", le="+Inf", **lbl) == 4
    assert _value(got, "kvgrid_request_queue_time_seconds_count", **lbl) == 2
    assert _value(got, "kvgrid_request_queue_time_seconds_sum", **lbl) == pytest.approx(2.01)
    assert _value(got, "kvgrid_request_prefill_time_seconds_sum", **lbl) == pytest.approx(0.51)
    assert _value(got, "kvgrid_request_decode_time_seconds_bucket", le="0.5", **lbl) == 1
    assert _value(got, "kvgrid_request_decode_time_seconds_count", **lbl) == 2
    tier = "kvgrid_prefix_cache_hit_tokens_total"
    assert [_value(got, tier, tier=t, **lbl) for t in ("gpu", "host", "disk")] == [20, 50, 10]
    # Shares from the summed tokens (300 of 400), never the mean of the replicas' shares (0.5).
    assert _value(got, "kvgrid_prefix_hit_rate", **lbl) == pytest.approx(0.75)
    assert _value(got, "kvgrid_prefix_hit_rate_window", window="1m", **lbl) == pytest.approx(0.75)
    assert _value(got, "kvgrid_hit_rate_drop_active", **lbl) == 1  # any replica in a drop
    assert _value(got, "kvgrid_hit_rate_drop_block", **lbl) == 21  # the newest alert's block
    # No _created samples (one per replica, not a total), no hidden merge inputs, the registry's families in order.
    assert "_created" not in text and "#" not in text.replace("# HELP", "").replace("# TYPE", "")
    assert [f.name for f in text_string_to_metric_families(text)] == [f.name for f in a.registry.collect()]


def test_one_replica_merged_is_its_own_registry_without_created_samples():
    m = _metrics(n=2, cached=50)
    m._n["e2e"].observe(0.7)
    snap = take(m.registry, tenant_extras(m))
    text = render(snap, snap.counts, merge_gauges([snap.gauges], snap.counts)).decode()
    own = [ln for ln in generate_latest(m.registry).decode().splitlines() if "_created" not in ln]
    assert text.splitlines() == own


def test_a_sample_only_another_replica_has_is_shown_in_order():
    a, b = _metrics(), _metrics()
    b.e2e.labels("acme", "other-model").observe(2.0)  # a label set the first replica never saw
    sa, sb = take(a.registry), take(b.registry)
    counts = {k: sa.counts.get(k, 0.0) + sb.counts.get(k, 0.0) for k in {*sa.counts, *sb.counts}}
    text = render(sa, counts, merge_gauges([sa.gauges, sb.gauges], counts)).decode()
    lines = [ln for ln in text.splitlines() if 'model_name="other-model"' in ln]
    les = [ln.split('le="')[1].split('"')[0] for ln in lines if "_bucket" in ln]
    assert les[-1] == "+Inf" and [float(x) for x in les] == sorted(float(x) for x in les)
    assert lines[-2].startswith("kvgrid_e2e_request_latency_seconds_count") and lines[-1].endswith(" 2.0")
    assert _value(_samples(text), "kvgrid_e2e_request_latency_seconds_bucket", model_name="other-model", le="2.5") == 1


# -- through Redis -------------------------------------------------------------------------------------------------


def _client(redis_client) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(f"unix://{redis_client.socket_file}", socket_timeout=1)


def test_a_replica_that_disappears_keeps_its_counts_and_counters_never_go_down(redis_client):
    a, b, c = _metrics(n=3), _metrics(n=5, cached=40), _metrics()

    async def run() -> list[dict]:
        r = _client(redis_client)
        ra, rb, rc = (ReplicaMetrics(r, {"acme": _source(m)}, replica_id=i) for m, i in ((a, "a"), (b, "b"), (c, "c")))
        seen = []

        async def scrape(via: ReplicaMetrics) -> dict:
            seen.append(_samples((await via.exposition("acme")).decode()))
            return seen[-1]

        await rb.publish()
        await rb.publish()  # the same values again (a retry after a lost reply) add nothing
        both = await scrape(ra)
        # b dies without a word: its heartbeat expires (here: at once); it never publishes again.
        redis_client.delete("kvgrid:metrics:alive:b")
        a.record(100, 0, 10, 0, 0)
        after = await scrape(ra)
        # A replica started after it (c) adds its own; b's counts are still there, its gauges are not.
        c.record(100, 100, 10, 0, 100)
        joined = await scrape(rc)
        # An old copy of b's values arriving late (its id, lower values) lowers nothing.
        stale = ReplicaMetrics(r, {"acme": _source(_metrics(n=1))}, replica_id="b")
        await stale.publish()
        redis_client.delete("kvgrid:metrics:alive:b")
        last = await scrape(ra)
        for m in (ra, rc):
            await m.close()
        await r.aclose()
        return [both, after, joined, last]

    both, after, joined, last = asyncio.run(asyncio.wait_for(run(), 60))
    req = [_value(s, "kvgrid_requests_total", tenant="acme") for s in (both, after, joined, last)]
    assert req == [8, 9, 10, 10]
    assert _value(both, "kvgrid_prefix_hit_rate", tenant="acme") == pytest.approx(200 / 800)
    # The window share is over the live replicas: b's 200 cached tokens are gone from it once b is.
    assert _value(both, "kvgrid_prefix_hit_rate_window", window="1m") == pytest.approx(200 / 800)
    assert _value(after, "kvgrid_prefix_hit_rate_window", window="1m") == 0
    assert _value(joined, "kvgrid_prefix_hit_rate_window", window="1m") == pytest.approx(100 / 500)
    # ... the share since the start keeps every replica's tokens.
    assert _value(joined, "kvgrid_prefix_hit_rate", tenant="acme") == pytest.approx(300 / 1000)
    # Closed replicas withdrew their gauges and heartbeats; their counts stay.
    assert not redis_client.smembers(REPLICAS_KEY) - {b"b"}
    totals = {decode(k)[1]: float(v) for k, v in redis_client.hgetall("kvgrid:metrics:acme:totals").items()}
    assert totals["kvgrid_requests_total"] == 10


def test_redis_losing_its_data_is_followed_by_a_full_resend(redis_client):
    m = _metrics(n=4)

    async def run() -> dict:
        r = _client(redis_client)
        rm = ReplicaMetrics(r, {"acme": _source(m)}, replica_id="a")
        await rm.publish()
        redis_client.flushall()  # a Redis restarted without its data
        m.record(100, 0, 10, 0, 0)
        await rm.publish()  # only what changed: Redis answers that the replica's applied values are gone
        got = _samples((await rm.exposition("acme")).decode())  # so this one resent everything
        await rm.close()
        await r.aclose()
        return got

    got = asyncio.run(asyncio.wait_for(run(), 60))
    assert _value(got, "kvgrid_requests_total") == 5 and _value(got, "kvgrid_output_tokens_total") == 50
    assert _value(got, "kvgrid_time_to_first_token_seconds_bucket", le="+Inf") == 0  # unchanged, resent: 0
    assert _value(got, "kvgrid_prompt_tokens_total") == 500


def test_an_idle_tenant_is_taken_less_often_and_its_next_change_still_lands(redis_client):
    from router.gateway.replica_metrics import IDLE_ROUNDS

    ms = {f"t{i}": _metrics(f"t{i}", n=1) for i in range(3)}

    async def run() -> tuple[list[int], int]:
        r = _client(redis_client)
        rm = ReplicaMetrics(r, {name: _source(m) for name, m in ms.items()}, replica_id="a")
        taken = [len(await rm._publish_once()) for _ in range(2 * IDLE_ROUNDS)]  # nothing changes
        ms["t1"].record(100, 0, 10, 0, 0)
        rounds = 0
        while True:
            rounds += 1
            await rm._publish_once()
            totals = {decode(k)[1]: float(v) for k, v in redis_client.hgetall("kvgrid:metrics:t1:totals").items()}
            if totals.get("kvgrid_requests_total") == 2 or rounds > IDLE_ROUNDS + 1:
                break
        await rm.close()
        await r.aclose()
        return taken, rounds

    taken, rounds = asyncio.run(asyncio.wait_for(run(), 60))
    assert taken[0] == 3 and sum(taken[-IDLE_ROUNDS:]) == 3  # at the end, each idle tenant once in IDLE_ROUNDS
    assert rounds <= IDLE_ROUNDS + 1  # the change is published within one backoff


def test_without_redis_a_scrape_fails_and_publishing_logs_once(caplog):
    port = free_port()  # nothing listens there
    m = _metrics(n=1)

    async def run() -> None:
        r = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.2, socket_connect_timeout=0.2)
        rm = ReplicaMetrics(r, {"acme": _source(m)}, interval_s=0.05)
        with pytest.raises(StoreUnavailable):
            await rm.exposition("acme")  # 503: never this replica's counts alone (a counter reset to Prometheus)
        rm.start()
        await asyncio.sleep(1.0)
        await rm.close()
        await r.aclose()

    with caplog.at_level(logging.WARNING, logger="router.gateway.replica_metrics"):
        asyncio.run(asyncio.wait_for(run(), 60))
    lines = [r.getMessage() for r in caplog.records if r.name == "router.gateway.replica_metrics"]
    assert sum("published again once Redis is back" in ln for ln in lines) == 1, lines


# -- a real server with two gateway replicas -----------------------------------------------------------------------

BODY = f"admin_keys: [{ADMIN_KEY}]\n" + TWO_TENANTS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    defaults = TEST_DEFAULTS.replace("groups: 2", "groups: 1")
    with serving(
        tmp_path_factory, BODY, [("acme", ACME_KEY), ("globex", GLOBEX_KEY)], defaults=defaults, http="replicas: 2"
    ) as srv:
        wait_for(lambda: len(_gateways(srv)) == 2, 60, "two gateway replicas")
        yield srv


def _gateways(server) -> set[int]:
    """Pids of the server's gateway replicas (Ray workers under the `kvgrid serve` process)."""
    pids = set()
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::ServeReplica:") and "gateway" in title.lower():
            pids.add(p.pid)
    return pids


def _get(url: str, key: str) -> str:
    """One scrape on a connection of its own (so the kernel may hand it to either replica); a connection reset by
    a replica being killed is tried again."""
    for _ in range(20):
        try:
            r = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        assert r.status_code == 200, r.text
        return r.text
    raise AssertionError(f"{url}: no answer")


def _tenant_requests(server, tenant: str = "acme", key: str = ACME_KEY) -> dict[str, float]:
    s = _samples(_get(f"{server.base}/{tenant}/metrics", key))
    return {
        "requests": _value(s, "kvgrid_requests_total", tenant=tenant),
        "e2e": _value(s, "kvgrid_e2e_request_latency_seconds_count", tenant=tenant),
        "inf": _value(s, "kvgrid_e2e_request_latency_seconds_bucket", tenant=tenant, le="+Inf"),
    }


def _admin_requests(server, tenant: str = "acme") -> float:
    s = _samples(_get(f"{server.base}/admin/v1/metrics", ADMIN_KEY))
    return _value(s, "kvgrid_tenant_requests_total", tenant=tenant)


def _send(server, n: int, tag: str) -> None:
    for i in range(n):  # a new connection each: both replicas serve some
        r = httpx.post(
            f"{server.base}/acme/v1/chat/completions",
            headers={"Authorization": f"Bearer {ACME_KEY}"},
            json={"model": "demo", "messages": [{"role": "user", "content": f"{tag} {i}"}], "max_tokens": 2},
            timeout=120,
        )
        assert r.status_code == 200, r.text


def _per_replica_requests(server) -> list[float]:
    """Each replica's own request count, as it published it (what one replica alone would have answered)."""
    r = redis.Redis.from_url(server.redis_url, socket_timeout=5)
    try:
        out = []
        for key in r.scan_iter("kvgrid:metrics:acme:seen:*"):
            seen = {decode(k): float(v) for k, v in r.hgetall(key).items() if k != b"#"}  # "#": a marker
            out.append(sum(v for k, v in seen.items() if k[1] == "kvgrid_requests_total"))
        return out
    finally:
        r.close()


def test_twenty_scrapes_in_a_row_each_see_every_request_once(server):
    _send(server, REQUESTS, "scrape")
    want = {"requests": REQUESTS, "e2e": REQUESTS, "inf": REQUESTS}
    wait_for(lambda: _tenant_requests(server) == want, 30, "every replica's samples in a scrape")
    # Both replicas served some (so neither alone could answer REQUESTS): the merge is what adds up.
    per = _per_replica_requests(server)
    assert len(per) == 2 and sum(per) == REQUESTS and min(per) > 0, per
    got = [_tenant_requests(server) for _ in range(SCRAPES)]
    assert got == [want] * SCRAPES
    assert _value(_samples(_get(f"{server.base}/globex/metrics", GLOBEX_KEY)), "kvgrid_requests_total") == 0
    # The admin API's ledger counters (Redis) likewise.
    wait_for(lambda: _admin_requests(server) == REQUESTS, 30, "the ledger")
    assert [_admin_requests(server) for _ in range(SCRAPES)] == [REQUESTS] * SCRAPES


def test_counters_never_go_down_while_a_replica_is_killed_and_replaced(server):
    _send(server, 6, "before")  # both replicas hold counts of their own (alone, this test starts from zero)

    def settled() -> float | None:  # every replica has published: the merged count is the ledger's
        ledger = _admin_requests(server)
        return ledger if ledger >= 6 and _tenant_requests(server)["requests"] == ledger else None

    before = wait_for(settled, 30, "every replica's samples")
    pids = _gateways(server)
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    seen = [_tenant_requests(server)["requests"] for _ in range(SCRAPES)]  # while it is gone and replaced
    wait_for(lambda: len(_gateways(server) - {victim}) == 2, 120, "the replacement gateway replica")
    _send(server, 4, "after")
    wait_for(lambda: _tenant_requests(server)["requests"] == before + 4, 30, "the new requests")
    seen += [_tenant_requests(server)["requests"] for _ in range(SCRAPES)]
    assert seen[:SCRAPES] == [before] * SCRAPES  # the killed replica's counts stayed in the totals
    assert seen[SCRAPES:] == [before + 4] * SCRAPES
    wait_for(lambda: _admin_requests(server) == before + 4, 30, "the ledger")
