"""The gateway's hedged routing (``Gateway._route``) against router replicas that answer late, never, or fail:
the first decision wins, every other replica asked forgets the route, and a slow replica is asked last after."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from router.gateway import HEDGE_DELAY_S, ROUTE_TIMEOUT_S, Gateway

ATTEMPT = "acme-0123-0"


class Replica:
    """What ``_route`` uses of a router replica's actor handle: ``route.remote`` decides after ``delay_s``
    (never when None) or fails with ``error``; the request ids of ``on_finish.remote`` are recorded."""

    def __init__(self, name: str, delay_s: float | None = 0.0, error: Exception | None = None) -> None:
        self.name, self.delay_s, self.error = name, delay_s, error
        self.asked: list[str] = []
        self.forgot: list[str] = []
        self.route = SimpleNamespace(remote=self._route)
        self.on_finish = SimpleNamespace(remote=self.forgot.append)

    async def _route(self, tenant: str, prompt: list[int], attempt: str, failed: list[str]):
        self.asked.append(attempt)
        if self.delay_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return SimpleNamespace(group=f"group-of-{self.name}")


def gateway(*replicas: Replica) -> SimpleNamespace:
    """The gateway state ``_route`` reads; the first replica is asked first."""
    return SimpleNamespace(routers=list(replicas), _next_router=len(replicas) - 1,
                           _router_failed_at=[-math.inf] * len(replicas))


async def route(gw, attempt: str = ATTEMPT):
    started = time.monotonic()
    router, decision = await Gateway.func_or_class._route(gw, SimpleNamespace(name="acme"), [1, 2, 3], attempt, [], "openai")
    return router, decision, time.monotonic() - started


def test_a_silent_replica_is_hedged_and_forgets_the_route_and_is_asked_last_after():
    slow, fast = Replica("slow", delay_s=None), Replica("fast")
    gw = gateway(slow, fast)

    async def scenario():
        router, decision, took = await route(gw)
        assert router is fast and decision.group == "group-of-fast"
        assert HEDGE_DELAY_S <= took < ROUTE_TIMEOUT_S  # no wait for the failover timeout
        assert slow.forgot == [ATTEMPT] and fast.forgot == []  # only the replica that serves it counts it
        router, _, took = await route(gw, "acme-4567-0")  # the slow replica's turn, but it is tried last now
        assert router is fast and took < HEDGE_DELAY_S and slow.asked == [ATTEMPT]

    asyncio.run(scenario())


def test_the_first_decision_wins_and_the_replica_asked_next_forgets_its_own():
    late, later = Replica("late", delay_s=HEDGE_DELAY_S + 0.05), Replica("later", delay_s=1.0)
    gw = gateway(late, later)

    async def scenario():
        router, _, took = await route(gw)
        assert router is late and took < 1.0
        assert later.asked == [ATTEMPT] and later.forgot == [ATTEMPT] and late.forgot == []
        assert gw._router_failed_at == [-math.inf, -math.inf]  # it answered: neither counts as slow

    asyncio.run(scenario())


def test_a_failed_replica_hands_over_without_waiting_for_the_hedge():
    dead, alive = Replica("dead", error=RayActorError()), Replica("alive")
    gw = gateway(dead, alive)

    async def scenario():
        router, _, took = await route(gw)
        assert router is alive and took < HEDGE_DELAY_S
        assert dead.forgot == [ATTEMPT] and gw._router_failed_at[0] > -math.inf

    asyncio.run(scenario())


def test_a_client_leaving_while_replicas_route_makes_every_replica_asked_forget():
    a, b = Replica("a", delay_s=None), Replica("b", delay_s=None)
    gw = gateway(a, b)

    async def scenario():
        task = asyncio.ensure_future(route(gw))
        await asyncio.sleep(HEDGE_DELAY_S + 0.1)
        assert a.asked == b.asked == [ATTEMPT]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert a.forgot == b.forgot == [ATTEMPT]

    asyncio.run(scenario())
