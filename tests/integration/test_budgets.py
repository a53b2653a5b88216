"""Tenants' budgets (router/gateway/budgets.py): the hard one holds under concurrency over two replicas sharing
Redis, refusals are 429s in each API's shape naming the budget, a request failing before generation releases its
reservation, periods reset, the soft threshold raises its metric, ``/v1/usage`` shows the budget, bad config is
refused. In-process gateways (no Ray) whose ``Generation.generate`` is a stand-in answering one token."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import httpx2
import pytest
from pydantic import ValidationError

from common.config import ServeConfig, TenantConfig, config_error_message
from common.outputs import FinishReason, RequestOutput
from router.gateway.budgets import Budgets, period_bounds
from router.gateway.core import Gateway
from router.gateway.errors import err
from router.gateway.generation import GenerateRequest
from router.gateway.store import KeyRing

KEY = "sk-acme-budgets-01"
MAX_TOKENS = 100
# Input and cache reads free, output $1 per million tokens: a request reserves MAX_TOKENS micro-dollars (its
# worst case) and costs 1 (the stand-in's one token). The hard budget fits 5 reservations.
PRICES = {"input": 0, "cache_read": 0, "output": 1}
HARD = 5 * MAX_TOKENS / 1e6


def config(demo_path, budget: dict | None) -> ServeConfig:
    tenant: dict[str, Any] = {"name": "acme", "api_keys": [KEY], "prices": PRICES}
    if budget is not None:
        tenant["budget"] = budget
    return ServeConfig.model_validate({"model": str(demo_path), "tenants": [tenant]})


def gateway(demo_path, redis_client, budget: dict | None) -> Gateway:
    cfg = config(demo_path, budget)
    return Gateway(cfg, KeyRing.from_config(cfg), str(demo_path), [None], f"unix://{redis_client.socket_file}")


def stand_in(gw: Gateway, gate: asyncio.Event | None = None, fail: bool = False) -> list[int]:
    """``gw.generation.generate`` answers one token (after ``gate`` opens); ``fail``: fails before generating."""
    started: list[int] = []

    def generate(req: GenerateRequest):
        async def outputs():
            if fail:
                raise err(503, "no worker group is available", req.api)
            started.append(1)
            if gate is not None:
                await gate.wait()
            out = RequestOutput("r", req.tenant.name, req.prompt, [5], "ok", [5], "ok", True, FinishReason.STOP, 0)
            req.account(out, 0)
            yield out, 0

        return outputs()

    gw.generation.generate = generate  # type: ignore[method-assign]
    return started


def run(gws: list[Gateway], test) -> Any:
    from router.gateway.app import create_app

    async def main() -> Any:
        clients = [
            httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(gw)), base_url="http://gw", timeout=60)
            for gw in gws
        ]
        try:
            return await test(clients)
        finally:
            for c in clients:
                await c.aclose()
            for gw in gws:
                await gw.close()

    return asyncio.run(asyncio.wait_for(main(), 60))


async def usage(http: httpx2.AsyncClient) -> dict:
    r = await http.get("/acme/v1/usage", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["budget"]


def post_chat(http: httpx2.AsyncClient, model: str):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS}
    return http.post("/acme/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})


def test_hard_budget_holds_over_two_replicas_and_refusals_name_it(demo_path, redis_client):
    gws = [gateway(demo_path, redis_client, {"period": "daily", "hard_usd": HARD}) for _ in range(2)]

    async def test(clients: list[httpx2.AsyncClient]) -> None:
        gate = asyncio.Event()
        started = [stand_in(gw, gate) for gw in gws]
        model = gws[0].model_id
        tasks = [asyncio.ensure_future(post_chat(clients[i % 2], model)) for i in range(20)]
        while sum(len(s) for s in started) + sum(t.done() for t in tasks) < 20:
            await asyncio.sleep(0.01)
        # Every request has either started generating (holding its reservation) or been refused.
        state = await usage(clients[0])
        assert state["spent_usd"] == 0 and state["reserved_usd"] == pytest.approx(HARD) and state["left_usd"] == 0
        gate.set()
        answers = await asyncio.gather(*tasks)
        assert sorted(r.status_code for r in answers) == [200] * 5 + [429] * 15
        for r in answers:
            if r.status_code == 429:
                error = r.json()["error"]
                assert error["code"] == 429 and set(error) == {"message", "type", "param", "code"}
                assert error["message"].startswith("this tenant's daily budget of 0.00 USD (budget.hard_usd) is spent")
                assert (
                    "it resets at " + period_bounds("daily", datetime.now(UTC).timestamp())[1].isoformat()
                    in (error["message"])
                )
        for gw in gws:
            await gw.accounting.close()  # the settlements, written in the background
        state = await usage(clients[1])
        # spent + reserved never exceeds hard: the 5 admitted reserved it all, and spent 1 micro-dollar each.
        assert state["spent_usd"] == pytest.approx(5e-6) and state["reserved_usd"] == 0
        assert state["period"] == "daily" and state["hard_usd"] == HARD
        assert state["left_usd"] == pytest.approx(HARD - 5e-6)
        assert datetime.fromisoformat(state["resets_at"]) > datetime.now(UTC)

    run(gws, test)


def test_refusals_in_anthropic_and_gemini_shapes(demo_path, redis_client):
    gw = gateway(demo_path, redis_client, {"period": "monthly", "hard_usd": 0})

    async def test(clients: list[httpx2.AsyncClient]) -> None:
        stand_in(gw)
        http, model = clients[0], gw.model_id
        r = await http.post(
            "/acme/v1/messages",
            json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": KEY},
        )
        assert r.status_code == 429 and r.json()["type"] == "error"
        assert r.json()["error"]["message"].startswith(
            "this tenant's monthly budget of 0.00 USD (budget.hard_usd) is spent"
        )
        r = await http.post(
            f"/acme/v1beta/models/{model}:generateContent",
            json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
            headers={"x-goog-api-key": KEY},
        )
        error = r.json()["error"]
        assert r.status_code == 429 and error["code"] == 429 and error["status"] == "RESOURCE_EXHAUSTED"
        assert "monthly budget" in error["message"] and "resets at" in error["message"]
        assert (await usage(http))["reserved_usd"] == 0

    run([gw], test)


def test_a_request_failing_before_generation_releases_its_reservation(demo_path, redis_client):
    gw = gateway(demo_path, redis_client, {"period": "total", "hard_usd": HARD})

    async def test(clients: list[httpx2.AsyncClient]) -> None:
        stand_in(gw, fail=True)
        for _ in range(10):  # twice what the budget holds: each reservation was released
            assert (await post_chat(clients[0], gw.model_id)).status_code == 503
            await gw.accounting.close()
        state = await usage(clients[0])
        assert state == {
            "period": "total",
            "spent_usd": 0,
            "reserved_usd": 0,
            "soft_usd": None,
            "hard_usd": HARD,
            "left_usd": HARD,
            "resets_at": None,
        }

    run([gw], test)


def test_soft_threshold_raises_the_metric(demo_path, redis_client):
    gw = gateway(demo_path, redis_client, {"period": "daily", "soft_usd": 2e-6})

    async def test(clients: list[httpx2.AsyncClient]) -> None:
        stand_in(gw)
        labels = {"tenant": "acme", "model_name": gw.model_id}
        reg = gw.tenants["acme"].metrics.registry
        for i in range(3):
            assert (await post_chat(clients[0], gw.model_id)).status_code == 200
            await gw.accounting.close()
            assert reg.get_sample_value("kvgrid_budget_spent_dollars", labels) == pytest.approx((i + 1) * 1e-6)
            assert reg.get_sample_value("kvgrid_budget_soft_exceeded", labels) == (1 if i == 2 else 0)
        assert (await usage(clients[0]))["left_usd"] is None  # no hard budget: unlimited

    run([gw], test)


def test_periods_reset(redis_client):
    from router.gateway.store import connect

    async def main() -> None:
        client = connect(f"unix://{redis_client.socket_file}")
        now = [datetime(2026, 1, 31, 23, 0, tzinfo=UTC).timestamp()]
        b = Budgets(client, clock=lambda: now[0])
        b.set_budget(
            "acme",
            TenantConfig.model_validate(
                {"name": "acme", "api_keys": [KEY], "budget": {"period": "monthly", "hard_usd": 1}}
            ).budget,
        )
        b.set_budget(
            "acme/key-1",
            TenantConfig.model_validate(
                {"name": "acme", "api_keys": [KEY], "budget": {"period": "daily", "hard_usd": 1}}
            ).budget,
        )
        for scope in ("acme", "acme/key-1"):
            res = await b.reserve(scope, 10**12)  # a dollar
            assert (await b.state(scope)).reserved_usd == 1  # type: ignore[union-attr]
            await b.settle(res, 10**12)
            with pytest.raises(Exception, match="is spent"):
                await b.reserve(scope, 1)
        assert (await b.state("acme")).resets_at == "2026-02-01T00:00:00+00:00"  # type: ignore[union-attr]
        now[0] += 3600  # past midnight, the first of the month: both reset
        for scope in ("acme", "acme/key-1"):
            assert (await b.state(scope)).spent_usd == 0  # type: ignore[union-attr]
            assert await b.reserve(scope, 10**12) is not None
        assert (await b.state("acme")).resets_at == "2026-03-01T00:00:00+00:00"  # type: ignore[union-attr]
        assert period_bounds("monthly", datetime(2026, 12, 5, tzinfo=UTC).timestamp())[1] == datetime(
            2027, 1, 1, tzinfo=UTC
        )
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("budget", "field"),
    [
        ({"period": "daily", "hard_usd": -1}, "tenants[0].budget.hard_usd"),
        ({"period": "daily", "soft_usd": -1}, "tenants[0].budget.soft_usd"),
        (
            {"period": "daily", "soft_usd": 5, "hard_usd": 1},
            "tenants[0].budget: soft_usd: the soft budget must not exceed hard_usd",
        ),
        ({"period": "weekly", "hard_usd": 1}, "tenants[0].budget.period"),
    ],
)
def test_bad_budget_config_is_refused_naming_the_field(demo_path, budget, field):
    with pytest.raises(ValidationError) as info:
        ServeConfig.model_validate(
            {"model": str(demo_path), "tenants": [{"name": "acme", "api_keys": [KEY], "budget": budget}]}
        )
    assert field in config_error_message(info.value, "kvgrid.yaml")
