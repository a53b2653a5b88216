"""The gateway's hedged routing (``RouterPool.route``, router/gateway/router_pool.py) against router replicas that
answer late, never, or fail: the first decision wins, every other replica asked cancels the route, and a slow
replica is asked last after; at most one hedge per request, within a budget."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError, RayError, RayTaskError

from common.errors import NoGroup, Overloaded
from router.clients import RouterClient
from router.gateway.errors import ApiError
from router.gateway.router_pool import HEDGE_DELAY_S, ROUTE_TIMEOUT_S, HedgeBudget, RouterPool
from router.routing.router import RouteDecision, RouteNote

ATTEMPT = "acme-0123-0"


class Replica:
    """What ``route`` uses of a router replica's actor handle: ``route.remote`` decides after ``delay_s``
    (never when None; when ``gate`` is set, once it is set) or fails with ``error``; the request ids of
    ``cancel_route.remote`` (``forgot``) and ``on_finish.remote`` (``finished``), and the event lists of
    ``report.remote`` (``reported``), are recorded."""

    def __init__(
        self, name: str, delay_s: float | None = 0.0, error: Exception | None = None, gate: asyncio.Event | None = None
    ) -> None:
        self.name, self.delay_s, self.error, self.gate = name, delay_s, error, gate
        self.asked: list[str] = []
        self.asked_at: list[float] = []
        self.forgot: list[str] = []
        self.finished: list[str] = []
        self.choices: list[int] = []  # the n each route call carried
        self.route = SimpleNamespace(remote=self._route)
        self.cancel_route = SimpleNamespace(remote=self.forgot.append)
        self.on_finish = SimpleNamespace(remote=self.finished.append)
        self.reported: list[list[tuple]] = []
        self.report = SimpleNamespace(remote=self.reported.append)

    async def _route(
        self,
        tenant: str,
        prompt: list[int],
        attempt: str,
        failed: list[str],
        cache_key: str | None = None,
        n: int = 1,
        adapter: str | None = None,
    ):
        self.asked.append(attempt)
        self.choices.append(n)
        self.asked_at.append(time.monotonic())
        if self.gate is not None:
            await self.gate.wait()
        elif self.delay_s is None:
            await asyncio.Event().wait()
        else:
            await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        group = f"group-of-{self.name}"
        return RouteDecision(attempt, group, 0, note=RouteNote(attempt, group, len(prompt), [], tenant, adapter, n))


def RouterError(cause: Exception) -> RayError:  # noqa: N802 (stands for the class the gateway sees)
    """What a router replica's own exception looks like to the gateway: a ``RayTaskError`` that is also an
    instance of the cause's class, with the cause in ``cause``."""
    return RayTaskError("route", "Traceback (router replica)", cause).as_instanceof_cause()


def gateway(*replicas: Replica, budget: HedgeBudget | None = None) -> RouterPool:
    """A gateway's pool of ``replicas``; the first replica is asked first."""
    pool = RouterPool([RouterClient(r) for r in replicas])
    pool._next_router = len(replicas) - 1
    pool._hedges = budget or HedgeBudget()
    return pool


async def route(gw, attempt: str = ATTEMPT):
    started = time.monotonic()
    router, decision = await gw.route("acme", [1, 2, 3], attempt, [], "openai")
    return router, decision, time.monotonic() - started


def test_a_silent_replica_is_hedged_and_forgets_the_route_and_is_asked_last_after():
    slow, fast = Replica("slow", delay_s=None), Replica("fast")
    gw = gateway(slow, fast)

    async def scenario():
        router, decision, took = await route(gw)
        assert router.handle is fast and decision.group == "group-of-fast"
        assert HEDGE_DELAY_S <= took < ROUTE_TIMEOUT_S  # no wait for the failover timeout
        assert slow.forgot == [ATTEMPT] and fast.forgot == []  # only the replica that serves it counts it
        assert slow.finished == fast.finished == []  # a loser's route is cancelled, not finished
        router, _, took = await route(gw, "acme-4567-0")  # the slow replica's turn, but it is tried last now
        assert router.handle is fast and took < HEDGE_DELAY_S and slow.asked == [ATTEMPT]

    asyncio.run(scenario())


def test_the_first_decision_wins_and_the_replica_asked_next_forgets_its_own():
    late, later = Replica("late", delay_s=HEDGE_DELAY_S + 0.05), Replica("later", delay_s=1.0)
    gw = gateway(late, later)

    async def scenario():
        router, _, took = await route(gw)
        assert router.handle is late and took < 1.0
        assert later.asked == [ATTEMPT] and later.forgot == [ATTEMPT] and late.forgot == []
        assert gw._router_failed_at == [-math.inf, -math.inf]  # it answered: neither counts as slow

    asyncio.run(scenario())


def test_a_failed_replica_hands_over_without_waiting_for_the_hedge():
    dead, alive = Replica("dead", error=RayActorError()), Replica("alive")
    gw = gateway(dead, alive)

    async def scenario():
        router, _, took = await route(gw)
        assert router.handle is alive and took < HEDGE_DELAY_S
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


def test_a_decision_wins_over_an_overload_that_came_back_with_it():
    for _ in range(20):  # ``done`` is a set: its order is arbitrary
        gate = asyncio.Event()
        busy = Replica("busy", error=RouterError(Overloaded("full")), gate=gate)
        able = Replica("able", gate=gate)
        asyncio.run(_decision_and_overload(gateway(busy, able), gate, busy, able))


async def _decision_and_overload(gw, gate: asyncio.Event, busy: Replica, able: Replica) -> None:
    task = asyncio.ensure_future(route(gw))
    await asyncio.sleep(HEDGE_DELAY_S + 0.05)  # both asked
    gate.set()  # both answer in the same loop iteration
    router, decision, _ = await task
    assert router.handle is able and decision.group == "group-of-able"
    assert busy.forgot == [ATTEMPT] and able.forgot == []
    assert gw._router_failed_at == [-math.inf, -math.inf]  # it answered: not slow


def test_a_replica_that_answered_with_the_winner_is_not_taken_for_slow():
    for _ in range(20):
        gate = asyncio.Event()
        empty = Replica("empty", error=RouterError(NoGroup("none yet")), gate=gate)
        able = Replica("able", gate=gate)
        asyncio.run(_answered_with_the_winner(gateway(empty, able), gate, empty, able))


async def _answered_with_the_winner(gw, gate: asyncio.Event, empty: Replica, able: Replica) -> None:
    task = asyncio.ensure_future(route(gw))
    await asyncio.sleep(HEDGE_DELAY_S + 0.05)
    gate.set()
    router, _, _ = await task
    assert router.handle is able and gw._router_failed_at == [-math.inf, -math.inf]
    assert empty.forgot == [ATTEMPT]


def test_two_decisions_at_once_the_replica_asked_first_wins_and_the_other_cancels():
    gate = asyncio.Event()
    first, second = Replica("first", gate=gate), Replica("second", gate=gate)
    gw = gateway(first, second)

    async def scenario():
        task = asyncio.ensure_future(route(gw))
        await asyncio.sleep(HEDGE_DELAY_S + 0.05)
        gate.set()
        router, _, _ = await task
        assert router.handle is first and second.forgot == [ATTEMPT] and first.forgot == []

    asyncio.run(scenario())


def test_a_request_hedges_once_however_many_replicas_are_slow():
    a, b, c = Replica("a", delay_s=None), Replica("b", delay_s=None), Replica("c")
    gw = gateway(a, b, c)

    async def scenario():
        router, _, took = await route(gw)
        assert router.handle is c and took >= ROUTE_TIMEOUT_S  # the third is asked once the first timed out
        assert c.asked_at[0] - a.asked_at[0] >= ROUTE_TIMEOUT_S
        assert b.asked_at[0] - a.asked_at[0] < ROUTE_TIMEOUT_S  # the one hedge
        assert a.forgot == b.forgot == [ATTEMPT]

    asyncio.run(scenario())


def test_the_hedge_budget_stops_hedging_when_every_replica_is_slow():
    a, b = Replica("a", delay_s=4 * HEDGE_DELAY_S), Replica("b", delay_s=4 * HEDGE_DELAY_S)
    gw = gateway(a, b, budget=HedgeBudget(rate=0.25, burst=1.0))

    async def scenario():
        for i in range(9):
            await route(gw, f"acme-{i}-0")

    asyncio.run(scenario())
    asked = len(a.asked) + len(b.asked)
    assert asked == 9 + 1 + 2  # the saved-up hedge (request 0), then one per four requests (requests 4 and 8)
    assert gw._router_failed_at == [-math.inf, -math.inf]  # each answered: none counts as failed


def test_the_hedge_budget_earns_per_request_up_to_its_burst():
    budget = HedgeBudget(rate=0.5, burst=2.0)
    assert budget.spend() and budget.spend() and not budget.spend()
    budget.earn()
    assert not budget.spend()
    budget.earn()
    assert budget.spend() and not budget.spend()
    for _ in range(10):
        budget.earn()
    assert budget.spend() and budget.spend() and not budget.spend()


def test_an_overload_with_no_decision_answers_429():
    busy = Replica("busy", error=RouterError(Overloaded("full")))
    gw = gateway(busy, Replica("never", delay_s=None))

    async def scenario():
        with pytest.raises(ApiError) as err:
            await route(gw)
        assert err.value.status == 429

    asyncio.run(scenario())


def test_request_events_reach_each_replica_in_order_in_one_call_per_interval():
    from router.gateway.router_pool import RouterReports

    calls: dict[str, list[list[tuple[str, str]]]] = {"a": [], "b": []}
    a, b = (RouterClient(SimpleNamespace(report=SimpleNamespace(remote=calls[n].append))) for n in "ab")

    async def scenario():
        reports = RouterReports(interval_s=0.05)
        reports.add(a, "prefill_done", "r1")
        reports.add(b, "prefill_done", "r2")
        reports.add(a, "finish", "r1")
        assert calls == {"a": [], "b": []}  # nothing before the interval is up
        await asyncio.sleep(0.1)
        assert calls == {"a": [[("prefill_done", "r1"), ("finish", "r1")]], "b": [[("prefill_done", "r2")]]}
        reports.add(b, "finish", "r2")
        reports.flush()  # what closing the gateway does: sent now, and no timer left to send it twice
        await asyncio.sleep(0.1)
        assert calls["b"] == [[("prefill_done", "r2")], [("finish", "r2")]] and len(calls["a"]) == 1

    asyncio.run(scenario())


def test_each_replica_asked_gets_the_requests_own_n_whatever_the_number_of_replicas():
    slow, fast, third = Replica("slow", delay_s=None), Replica("fast"), Replica("third")
    gw = gateway(slow, fast, third)

    async def scenario():
        for n in (1, 4):
            await gw.route("acme", [1, 2, 3], f"acme-{n}-0", [], "openai", n=n)
        # the request's n, never the replica count (it once was: a request counted as 3 running)
        seen = slow.choices + fast.choices + third.choices
        assert set(seen) == {1, 4}

    asyncio.run(scenario())


def test_shared_routes_tell_the_other_replicas_after_a_losers_cancel_and_every_replica_hears_the_progress():
    slow, fast, idle = Replica("slow", delay_s=None), Replica("fast"), Replica("idle")
    gw = gateway(slow, fast, idle)

    async def scenario():
        router, decision, _ = await route(gw)
        assert router.handle is fast and slow.forgot == [ATTEMPT]
        assert slow.reported == idle.reported == []  # the note waits for the next flush: after the cancel
        gw.reports.add(router, "prefill_done", ATTEMPT)
        gw.reports.add(router, "finish", ATTEMPT)
        await asyncio.sleep(2 * HEDGE_DELAY_S)  # (the report interval)
        progress = [("prefill_done", ATTEMPT), ("finish", ATTEMPT)]
        for other in (slow, idle):  # one call each, the note first; the replica never asked is told too
            assert other.reported == [[("note", decision.note), *progress]]
        assert fast.reported == [progress]  # the winner counts its own route already

    asyncio.run(scenario())


def test_without_shared_routes_only_the_routing_replica_hears_of_the_request():
    slow, fast = Replica("slow", delay_s=None), Replica("fast")
    gw = RouterPool([RouterClient(r) for r in (slow, fast)], share_routes=False)
    gw._next_router = 1

    async def scenario():
        router, _, _ = await route(gw)
        gw.reports.add(router, "finish", ATTEMPT)
        gw.reports.flush()
        assert fast.reported == [[("finish", ATTEMPT)]] and slow.reported == [] and slow.forgot == [ATTEMPT]

    asyncio.run(scenario())


class ServiceHandle:
    """A real ``RouterService`` behind the ``.remote`` methods the pool calls; its routes wait for ``gate``."""

    def __init__(self, gate: asyncio.Event) -> None:
        from router.routing.service import RouterService

        async def no_events(offset: int) -> tuple[list, int]:
            return [], offset

        leader = SimpleNamespace(read_events=SimpleNamespace(remote=no_events))
        self.service = svc = RouterService({"g0": leader, "g1": leader, "g2": leader}, b"pool-test-secret")

        self.routed: list[str] = []  # the request ids it routed

        async def route(*args):
            await gate.wait()
            decision = await svc.route(*args)
            self.routed.append(decision.request_id)
            return decision

        self.route = SimpleNamespace(remote=route)
        self.cancel_route = SimpleNamespace(remote=svc.cancel_route)
        self.report = SimpleNamespace(remote=svc.report)


def test_real_replicas_sharing_routes_count_the_same_load_through_hedges_and_return_to_zero():
    async def scenario():
        gate = asyncio.Event()
        a, b = ServiceHandle(gate), ServiceHandle(gate)
        gw = gateway(a, b)
        routed = []
        for i in range(6):
            prompt = list(range(100 * i, 100 * i + 48 + 16 * i))
            call = asyncio.ensure_future(gw.route("acme", prompt, f"r{i}", [], "openai"))
            if i == 0:  # both asked (a hedge), both route it: the first asked wins, the other cancels its own
                await asyncio.sleep(HEDGE_DELAY_S + 0.05)
            gate.set()
            routed.append(await call)
            gate.clear()
        gw.reports.flush()
        assert a.routed[0] == b.routed[0] == "r0" and routed[0][0].handle is a  # b routed r0 too, and lost
        ra, rb = a.service.router, b.service.router

        def loads(r) -> dict[str, tuple[int, int, float]]:  # (recent prefill decays on the wall clock: rounded)
            return {g: (x.queued_prefill_tokens, x.running, round(x.recent_prefill_tokens)) for g, x in r.loads.items()}

        assert loads(ra) == loads(rb) and ra.queued_by_tenant == rb.queued_by_tenant == {"acme": 48 * 6 + 16 * 15}
        for router, decision in routed:
            gw.reports.add(router, "prefill_done", decision.request_id)
        gw.reports.flush()
        assert loads(ra) == loads(rb) and sum(load.running for load in ra.loads.values()) == 6
        for router, decision in routed:
            gw.reports.add(router, "finish", decision.request_id)
        gw.reports.flush()
        for r in (ra, rb):
            assert all(load.queued_prefill_tokens == load.running == 0 for load in r.loads.values())

    asyncio.run(scenario())
