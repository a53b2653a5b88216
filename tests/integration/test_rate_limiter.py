"""The gateways' rate limiter (router/gateway/store.py ``RateLimiter``) on a real Redis: two limiter instances on
one Redis stand for two gateway replicas, and no window of a limit's length admits more than the limit, edges
included."""

from __future__ import annotations

import asyncio

import pytest

from harness import RedisServer
from router.gateway.store import RateLimiter, StoreUnavailable, connect

T0 = 1_000_000.0  # a made-up clock (admit's ``now``), seconds


def _url(redis_client) -> str:
    return f"unix://{redis_client.socket_file}"


def run(url: str, scenario):
    """``scenario(a, b)`` with two async clients of ``url`` (two replicas), closed after."""

    async def main():
        a, b = connect(url, 5.0), connect(url, 5.0)
        try:
            return await scenario(a, b)
        finally:
            await a.aclose()
            await b.aclose()

    return asyncio.run(main())


def test_requests_straddling_a_window_edge_are_held_to_the_rate(redis_client):
    async def scenario(ca, cb):
        a, b = RateLimiter(ca, 10, None), RateLimiter(cb, 10, None)
        burst = [await (a if i % 2 else b).admit("acme", 0, T0 + 0.95) for i in range(10)]
        past_edge = [await (a if i % 2 else b).admit("acme", 0, T0 + 1.05) for i in range(5)]
        slid = await a.admit("acme", 0, T0 + 1.951)
        other = await b.admit("globex", 0, T0 + 1.05)
        return burst, past_edge, slid, other

    burst, past_edge, slid, other = run(_url(redis_client), scenario)
    assert burst == [None] * 10
    # A fixed window would start afresh at T0 + 1: the sliding one still holds the 10 of T0 + 0.95.
    assert all(w == pytest.approx(0.9, abs=1e-3) for w in past_edge), past_edge
    assert slid is None and other is None


def test_no_one_second_window_admits_more_than_the_rate(redis_client):
    async def scenario(ca, cb):
        a, b = RateLimiter(ca, 5, None), RateLimiter(cb, 5, None)
        admitted = []
        for i in range(200):  # every 20 ms for 4 s, alternating replicas
            now = T0 + i * 0.02
            if await (a if i % 2 else b).admit("acme", 0, now) is None:
                admitted.append(now)
        return admitted

    admitted = run(_url(redis_client), scenario)
    assert max(sum(1 for t in admitted if s <= t < s + 1 - 1e-9) for s in admitted) == 5
    assert len(admitted) == 20  # and the rate is used: 5 in each of the 4 seconds


def test_tokens_per_minute_slide_and_the_retry_after_is_right(redis_client):
    async def scenario(ca, cb):
        a, b = RateLimiter(ca, None, 1000), RateLimiter(cb, None, 1000)
        out = [
            await a.admit("acme", 400, T0 + 59.0),
            await b.admit("acme", 500, T0 + 59.5),
            await a.admit("acme", 200, T0 + 60.5),  # 900 in the last minute: 200 more would be 1100
        ]
        retry = out[-1]
        out.append(await b.admit("acme", 200, T0 + 60.5 + retry - 0.01))  # just before: still refused
        out.append(await b.admit("acme", 200, T0 + 60.5 + retry + 0.001))  # the 400 of T0 + 59 have expired
        out.append(await a.admit("acme", 400, T0 + 119.2))  # 500 + 200 in the window: the 500 free it at T0 + 119.5
        out.append(await a.admit("acme", 1001, T0 + 500))  # more than a minute's worth: never (a minute)
        return out

    first, second, refused, early, later, third, too_big = run(_url(redis_client), scenario)
    assert first is None and second is None
    assert refused == pytest.approx(58.5, abs=1e-3)  # T0 + 59 + 60 - (T0 + 60.5)
    assert early is not None and early == pytest.approx(0.01, abs=1e-3)
    assert later is None
    assert third == pytest.approx(0.3, abs=1e-3)
    assert too_big == pytest.approx(60)


def test_a_refused_request_is_not_counted_and_both_limits_must_take_it(redis_client):
    async def scenario(ca, _cb):
        lim = RateLimiter(ca, 2, 100)
        out = [await lim.admit("acme", 60, T0), await lim.admit("acme", 60, T0 + 0.1)]  # tokens refuse the 2nd
        out.append(await lim.admit("acme", 40, T0 + 0.2))  # the refused one took no request slot
        out.append(await lim.admit("acme", 0, T0 + 0.3))  # 2 requests in the second: refused by the rate
        return out

    first, by_tokens, second, by_rate = run(_url(redis_client), scenario)
    assert first is None and by_tokens == pytest.approx(60 - 0.1, abs=1e-3)
    assert second is None and by_rate == pytest.approx(0.7, abs=1e-3)


def test_redis_time_is_used_without_now(redis_client):
    async def scenario(ca, cb):
        a, b = RateLimiter(ca, 3, None), RateLimiter(cb, 3, None)
        return [await (a if i % 2 else b).admit("acme", 0) for i in range(4)]

    out = run(_url(redis_client), scenario)
    assert out[:3] == [None] * 3 and 0 < out[3] <= 1.0


def test_redis_down_is_store_unavailable(tmp_path):
    server = RedisServer(tmp_path)
    try:

        async def scenario(ca, _cb):
            lim = RateLimiter(ca, 10, 1000)
            assert await lim.admit("acme", 5) is None
            server.stop()
            with pytest.raises(StoreUnavailable):
                await lim.admit("acme", 5)

        run(server.url, scenario)
    finally:
        server.stop()
