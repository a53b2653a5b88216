"""Monitoring: the hit-rate drop alarm on a simulated clock (fires within one window after a
planted prefix change, never under 10 minutes of steady traffic), the alert's log line, metric and admin API entry
through the gateway's own accounting (real Redis), request latencies; and on the shared server: every query of the
Grafana dashboard names a metric the server exports (a live scrape), latency histograms fill, and the cache
advisor's endpoint and ``kvgrid advise --url`` find a timestamp planted in a system prompt."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.config import ServeConfig
from common.outputs import FinishReason, RequestOutput
from harness import ACME_KEY, ADMIN_KEY, GLOBEX_KEY, SHARED_INITECH_KEY, SYSTEM, an, chat, oa
from router.cli import main
from router.gateway.monitoring import DropAlarm, RequestTiming, ShareWindows
from router.gateway.store import KeyRing

BLOCK = 16
DASHBOARD = Path(__file__).resolve().parents[2] / "router" / "gateway" / "grafana-dashboard.json"


class Traffic:
    """A tenant's requests on a simulated clock: one every ``gap_s`` (jittered); a share ``fresh`` of them are new
    conversations (nothing cached), the others reuse the shared prefix up to where the current prompt version
    still matches the cached one."""

    def __init__(self, seed: int, gap_s: float = 2.0, fresh: float = 0.2, prompt: int = 2000) -> None:
        self.rng, self.gap_s, self.fresh, self.n = random.Random(seed), gap_s, fresh, prompt
        self.now = 1_000_000.0
        self.prefix = [self.rng.randrange(50_000) for _ in range(prompt)]
        self.cached_upto = prompt - BLOCK  # the version the cache holds matches this far

    def change_prefix(self, at_token: int) -> None:
        """A release changes the prompt from token ``at_token`` on: the cache holds the old version."""
        self.prefix = self.prefix[:at_token] + [self.rng.randrange(50_000) for _ in range(self.n - at_token)]
        self.cached_upto = at_token // BLOCK * BLOCK

    def rewarm(self) -> None:
        self.cached_upto = self.n - BLOCK

    def step(self) -> tuple[float, list[int], int]:
        self.now += self.gap_s * self.rng.uniform(0.5, 1.5)
        prompt = self.prefix[: self.n - 8] + [self.rng.randrange(50_000) for _ in range(8)]  # a new question
        cached = 0 if self.rng.random() < self.fresh else self.cached_upto
        return self.now, prompt, cached


def _run(alarm: DropAlarm, traffic: Traffic, seconds: float) -> list:
    alerts, end = [], traffic.now + seconds
    while traffic.now < end:
        now, prompt, cached = traffic.step()
        alert = alarm.observe(prompt, cached, now)
        if alert is not None:
            alerts.append(alert)
    return alerts


def test_no_drop_alert_under_10_minutes_of_steady_traffic():
    fired = 0
    for seed in range(30):  # sparse and dense, few and many fresh conversations
        traffic = Traffic(seed, gap_s=random.Random(seed).choice([0.5, 2.0, 5.0]), fresh=0.1 + 0.3 * (seed % 3) / 2)
        fired += len(_run(DropAlarm("acme", BLOCK), traffic, 600))
    assert fired == 0


@pytest.mark.parametrize("at_token", [0, 300, 37 * BLOCK + 5])  # a hit then reads 0%, 14% or 30% (99% before)
def test_drop_alert_fires_within_one_window_after_a_prefix_change(at_token):
    for seed in range(10):
        traffic = Traffic(seed)
        alarm = DropAlarm("acme", BLOCK)
        assert _run(alarm, traffic, 600) == []
        changed = traffic.now
        traffic.change_prefix(at_token)
        alerts = _run(alarm, traffic, 120)
        assert len(alerts) == 1, f"seed {seed}: {len(alerts)} alerts"
        (alert,) = alerts
        assert alert.time - changed <= alarm.window_s  # within one window
        assert alert.block == at_token // BLOCK and alert.token == at_token  # where prompts stopped matching
        assert alert.share_now < alert.share_before / 2
        # The cache warms up on the new prefix: the alarm re-arms and stays quiet under steady traffic again.
        traffic.rewarm()
        assert _run(alarm, traffic, 600) == []
        assert alarm.active is None


def test_share_windows_and_request_timing():
    w = ShareWindows()
    w.add(100.0, 1000, 900)
    w.add(3000.0, 1000, 0)
    assert w.share(3000.0, 60) == 0.0 and w.share(3000.0, 3600) == pytest.approx(0.45)
    assert w.totals(3000.0, 300) == (1, 1000, 0)
    t = RequestTiming(10.0)
    t.tick(10.5, 1)  # the first token
    t.tick(10.7, 2)  # a step with two tokens: 0.1 s each
    t.tick(10.8, 0)  # nothing new
    t.finish(11.0)
    assert t.ttft == pytest.approx(0.5) and t.gaps == pytest.approx([0.1, 0.1]) and t.e2e == pytest.approx(1.0)
    # monitoring: {drop_alerts: false}: no alarm, the windows still count.
    from common.config import MonitoringConfig
    from router.gateway.tenant_metrics import TenantMetrics

    m = TenantMetrics("acme", BLOCK, MonitoringConfig(drop_alerts=False))
    assert m.alarm is None and m.record(100, 50, 1, 0, 50, now=5.0) is None and m.windows.share(5.0, 60) == 0.5


def _out(prompt: list[int], cached: int) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        tenant="acme",
        prompt_token_ids=prompt,
        token_ids=[1],
        text="",
        new_token_ids=[1],
        delta_text="",
        finished=True,
        finish_reason=FinishReason.LENGTH,
        num_cached_tokens=cached,
    )


def test_a_drop_alert_is_logged_counted_and_listed_on_the_admin_api(demo_path, redis_client, caplog):
    from router.gateway.admin import Admin, create_admin_app
    from router.gateway.app import create_app
    from router.gateway.core import Gateway
    from router.gateway.tenants import Slot

    config = ServeConfig.model_validate(
        {
            "admin_keys": [ADMIN_KEY],
            "tenants": [{"name": "acme", "api_keys": [ACME_KEY], "cache": {"min_prefix_tokens": 16}}],
        }
    )
    keys = KeyRing.from_config(config)
    gw = Gateway(config, keys, demo_path, [None], f"unix://{redis_client.socket_file}")
    app = create_app(gw, create_admin_app(Admin(keys, ["acme"], None, [])))  # type: ignore[arg-type]
    t = gw.tenants["acme"]
    slot = Slot(t)  # an in-flight place the fed requests are accounted to
    traffic = Traffic(3)
    t.metrics.clock = lambda: traffic.now

    async def run() -> tuple[dict, str, int]:
        def feed(seconds: float) -> None:
            end = traffic.now + seconds
            while traffic.now < end:
                _, prompt, cached = traffic.step()
                gw.accounting.account(slot, _out(prompt, cached), 0, cached)

        feed(600)
        traffic.change_prefix(21 * BLOCK)
        with caplog.at_level(logging.WARNING, logger="router.gateway.accounting"):
            feed(90)
        await asyncio.gather(*gw.accounting._background)  # the background write of the alert has landed
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            alerts = (await client.get("/admin/v1/alerts", headers={"x-api-key": ADMIN_KEY})).json()
            denied = (await client.get("/admin/v1/alerts", headers={"x-api-key": ACME_KEY})).status_code
            metrics = (await client.get("/acme/metrics", headers={"x-api-key": ACME_KEY})).text
        await gw.close()
        return alerts, metrics, denied

    alerts, metrics, denied = asyncio.run(asyncio.wait_for(run(), 120))  # a hang fails, never blocks the suite
    assert denied == 401
    (alert,) = alerts["alerts"]
    assert alert["tenant"] == "acme" and alert["block"] == 21 and alert["token"] == 21 * BLOCK
    lines = [r.getMessage() for r in caplog.records if "hit-rate drop" in r.getMessage()]
    assert len(lines) == 1 and "block 21" in lines[0] and "acme" in lines[0]
    samples = {s.name + json.dumps(s.labels, sort_keys=True): s.value for f in _families(metrics) for s in f.samples}
    acme = '"model_name": "demo", "tenant": "acme"'
    assert samples[f"kvgrid_hit_rate_drop_alerts_total{{{acme}}}"] == 1
    assert samples[f"kvgrid_hit_rate_drop_block{{{acme}}}"] == 21
    assert samples[f"kvgrid_hit_rate_drop_active{{{acme}}}"] == 1
    assert samples[f'kvgrid_prefix_hit_rate_window{{{acme}, "window": "1m"}}'] < 0.4


def _families(text: str):
    return list(text_string_to_metric_families(text))


def _dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"]]
    return exprs


def test_every_dashboard_query_names_an_exported_metric(shared_server):
    server = shared_server
    chat(oa(server), f"Dashboard check {random.randrange(10**9)}: when do you open?")  # some traffic first
    names: set[str] = set()
    for tenant, key in (("acme", ACME_KEY), ("globex", GLOBEX_KEY), ("initech", SHARED_INITECH_KEY)):
        text = httpx.get(f"{server.base}/{tenant}/metrics", headers={"x-api-key": key}, timeout=30).text
        names |= {s.name for f in _families(text) for s in f.samples}
    admin = httpx.get(f"{server.base}/admin/v1/metrics", headers={"x-api-key": ADMIN_KEY}, timeout=60).text
    names |= {s.name for f in _families(admin) for s in f.samples}
    queries = _dashboard_queries()
    assert len(queries) >= 15
    for q in queries:
        used = set(re.findall(r"\bkvgrid_[a-z0-9_]+", q))
        assert used, f"a dashboard query names no kvgrid metric: {q}"
        assert used <= names, f"{q}: {sorted(used - names)} not exported"
    # The latency histograms filled with the request above.
    acme = httpx.get(f"{server.base}/acme/metrics", headers={"x-api-key": ACME_KEY}, timeout=30).text
    counts = {s.name: s.value for f in _families(acme) for s in f.samples if s.name.endswith("_count")}
    for h in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert counts[f"kvgrid_{h}_seconds_count"] > 0, h
    for h in ("queue", "prefill", "decode"):  # from the engine's timings of the request
        assert counts[f"kvgrid_request_{h}_time_seconds_count"] > 0, h
    tiers = {
        s.labels["tier"]: s.value
        for f in _families(acme)
        for s in f.samples
        if s.name == "kvgrid_prefix_cache_hit_tokens_total"
    }
    assert set(tiers) == {"gpu", "host", "disk"}, tiers


def test_advice_endpoint_and_kvgrid_advise_find_a_planted_timestamp(shared_server, capsys):
    server = shared_server
    client = an(server, "initech", SHARED_INITECH_KEY)
    marker = f"Advisor check {random.randrange(10**9)}."
    for k in range(4):  # initech samples its last 8 prompts (harness.SHARED_BODY)
        system = f"{marker} {SYSTEM[:120]} Current time: 2026-12-01T10:0{k}:{17 + k}Z. {SYSTEM[120:]} " + SYSTEM
        client.messages.create(
            model="demo",
            max_tokens=2,
            extra_body={"temperature": 0},
            system=[{"type": "text", "text": system}],
            messages=[{"role": "user", "content": f"Question {k}: when do you open?"}],
        )
    r = httpx.get(f"{server.base}/initech/v1/cache/advice", headers={"x-api-key": SHARED_INITECH_KEY}, timeout=60)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["sampled"] >= 4
    found = [a for a in report["advice"] if a["varying_text"] and a["varying_text"][-1] == "2026-12-01T10:03:20Z"]
    assert found and found[0]["kind"] == "timestamp" and found[0]["message"] == 0
    assert found[0]["extra_cached_tokens"] >= BLOCK and found[0]["saving_per_request_usd"] > 0
    assert "breakpoints" in report  # initech is explicit
    # Off for a tenant without advice: a 404 that says how to turn it on; another tenant's key: 401.
    off = httpx.get(f"{server.base}/acme/v1/cache/advice", headers={"x-api-key": ACME_KEY}, timeout=30)
    assert off.status_code == 404 and "advice" in off.json()["error"]["message"]
    assert httpx.get(f"{server.base}/initech/v1/cache/advice", headers={"x-api-key": ACME_KEY}).status_code == 401
    # kvgrid advise asks the same endpoint.
    args = ["advise", "--url", server.base, "--tenant", "initech", "--key", SHARED_INITECH_KEY]
    assert main([*args, "--json"]) == 0
    assert any(a["kind"] == "timestamp" for a in json.loads(capsys.readouterr().out)["advice"])
    assert main(args) == 0
    assert "timestamp" in capsys.readouterr().out
    assert main(["advise", "--url", server.base, "--tenant", "acme", "--key", ACME_KEY]) == 2
