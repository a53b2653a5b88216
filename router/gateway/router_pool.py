"""The gateway's client of the router replicas (``RouterPool``): each request is routed by one replica, chosen
round robin with recently failed ones last, and hedged (a replica silent past ``HEDGE_DELAY_S`` is not waited on
alone: the next is asked too, within a budget). With ``routing.share_routes`` (the default) every other replica is
told of the route (``Router.note_route``) and every replica hears of the request's first token and end, so each
prices the groups on the whole fleet's load; without it only the routing replica hears of them. Both in batches
(``RouterReports``). A failed group is reported to every replica."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Sequence

from ray.exceptions import RayActorError, RayError

from common.errors import NoGroup, Overloaded, remote_cause
from common.hashing import token_array
from router.clients import RouterClient
from router.gateway.errors import err
from router.routing.router import RouteDecision, RouteNote

# A router replica that takes longer is skipped (it routes in about a millisecond; a killed one that Ray is
# restarting holds calls until it is back, seconds later)...
log = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 0.5
LAST_ROUTE_TIMEOUT_S = 30.0  # ...unless it is the last one left to try
HEDGE_DELAY_S = 0.05  # a replica routes in about a millisecond: one silent for longer is not waited on alone
# Hedges per routed request over time (and the most saved up): when every replica is slow, hedging every request
# would double the routing load on replicas already behind; past the budget a request waits for its timeout.
HEDGE_BUDGET = 0.1
HEDGE_BURST = 10.0
ROUTER_COOLDOWN_S = 10.0  # a replica that failed is tried last for this long (Ray restarts it meanwhile)
ROUTER_RETRY_AFTER_S = 2.0  # no router replica answered: a restarted one resyncs within a few seconds
# A router replica hears of its requests' first tokens and ends this late at most, in one call per interval: a
# call per event would cost the router about as much CPU as routing.
REPORT_INTERVAL_S = 0.05


class RouterReports:
    """Request events for the router replicas (``"note"``, ``"prefill_done"``, ``"finish"``), in order, one
    ``report`` call per replica every ``REPORT_INTERVAL_S`` while there are any. ``shared``: the replicas that share
    routes (none when the pool does not): each hears of the others' routes and of every request's progress.

    A request's note and its progress reach a replica through the same queue, note first, and a call's events are
    applied in order. Separate calls may not be: Ray runs a caller's calls to an async actor out of order at times
    (a few percent of calls sent milliseconds apart, measured on Ray 2.60), so the router takes them in any order
    (``Router.note_route``: a note after the request's end, or before a hedge's loser routes it, counts nothing
    twice). A hedge's loser gets ``cancel_route`` at once, the winner's note at the next flush."""

    def __init__(self, shared: Sequence[RouterClient] = (), interval_s: float = REPORT_INTERVAL_S) -> None:
        self.shared = list(shared)
        self.interval_s = interval_s
        self._pending: dict[int, tuple[RouterClient, list[tuple[str, str | RouteNote]]]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, router: RouterClient, kind: str, request_id: str) -> None:
        """A request's progress, for ``router`` (the replica that routed it), or for every replica when they share
        routes (each counts it)."""
        for r in self.shared or (router,):
            self._queue(r, (kind, request_id))

    def note(self, router: RouterClient, note: RouteNote) -> None:
        """A route ``router`` made, for every other replica that shares routes."""
        for r in self.shared:
            if r is not router:
                self._queue(r, ("note", note))

    def _queue(self, router: RouterClient, event: tuple[str, str | RouteNote]) -> None:
        entry = self._pending.get(id(router))
        if entry is None:
            entry = self._pending[id(router)] = (router, [])
        entry[1].append(event)
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.interval_s, self.flush)
            except RuntimeError:  # no loop any more (a request collected at shutdown): say it now
                self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, {}
        for router, events in pending.values():
            router.report(events)


class HedgeBudget:
    """A token bucket of hedges: every request routed earns ``rate`` of one (up to ``burst``), a hedge spends
    one. A replica slow now and then is hedged every time; all of them slow at once, only a few requests are."""

    def __init__(self, rate: float = HEDGE_BUDGET, burst: float = HEDGE_BURST) -> None:
        self.rate, self.burst, self.tokens = rate, burst, burst

    def earn(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.rate)

    def spend(self) -> bool:
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


FORGET_TIMEOUT_S = 40.0  # a deleted tenant's cleanup on the groups (each group's call is bounded at 30 s)


async def _bounded(awaitable, timeout_s: float):
    return await asyncio.wait_for(awaitable, timeout_s)


class RouterPool:
    """The router replicas one gateway replica asks (``route``), tells of its requests' progress (``reports``) and
    of failed groups (``report_failure``)."""

    def __init__(self, routers: Sequence[RouterClient], share_routes: bool = True) -> None:
        self.routers = list(routers)
        self._next_router = secrets.randbelow(len(self.routers))
        self._router_failed_at = [-math.inf] * len(self.routers)
        self._hedges = HedgeBudget()
        self.reports = RouterReports(self.routers if share_routes else ())

    async def forget_tenant(self, tenant: str, timeout_s: float = FORGET_TIMEOUT_S) -> dict[str, list[int]] | None:
        """Have the groups drop a deleted tenant's pins and unused cached blocks, through the first router replica
        that answers (one is enough: the removals reach every replica's index through the events); None when none
        did."""
        for r in self.routers:
            try:
                return await _bounded(r.forget_tenant(tenant), timeout_s)
            except Exception as exc:  # a dead or restarting replica: the next one
                log.warning("router replica did not forget tenant %s (%s: %s)", tenant, type(exc).__name__, exc)
        return None

    def report_failure(self, group: str, reason: str) -> None:
        """No replica should send more requests to ``group``."""
        for r in self.routers:
            r.report_failure(group, reason)

    async def route(
        self,
        tenant: str,
        prompt: list[int],
        attempt: str,
        failed: list[str],
        api: str,
        cache_key: str | None = None,
        n: int = 1,
        adapter: str | None = None,
    ) -> tuple[RouterClient, RouteDecision]:
        """(router replica, decision) from the first replica that routes the request. Hedged: a replica that has
        not answered within ``HEDGE_DELAY_S`` is not waited on alone, the next one is asked too (once per
        request, within ``HEDGE_BUDGET``), and the first decision wins; every other replica asked cancels the
        route (it may have made it too: its load, predictions and recent prefill are undone), so no replica
        counts the request twice; with shared routes every replica but the winner is then told of the winner's
        (``RouterReports.note``). A dead, restarting or stuck replica is skipped, and so is one that knows no
        group yet (just restarted: the supervisor hands it the groups within a second). 503 when none routes it
        (a retry a moment later works)."""
        tokens = token_array(prompt)  # one buffer: pickled and hashed as one, where a list goes id by id
        replicas = len(self.routers)  # (not ``n``: that is the request's choices, which the router counts)
        self._next_router = (self._next_router + 1) % replicas
        self._hedges.earn()
        now = time.monotonic()
        order = sorted(
            ((self._next_router + i) % replicas for i in range(replicas)),  # round robin, recent failures last
            key=lambda j: now - self._router_failed_at[j] < ROUTER_COOLDOWN_S,
        )
        pending: dict[asyncio.Future, int] = {}  # call -> position in ``order``
        asked = 0  # replicas asked so far: order[:asked]
        hedged = False
        no_group: str | None = None
        won: int | None = None

        def ask() -> None:
            nonlocal asked
            timeout_s = ROUTE_TIMEOUT_S if asked < replicas - 1 else LAST_ROUTE_TIMEOUT_S
            call = self.routers[order[asked]].route(tenant, tokens, attempt, failed, cache_key, n, adapter)
            pending[asyncio.ensure_future(_bounded(call, timeout_s))] = asked
            asked += 1

        ask()
        try:
            while pending:
                hedge = HEDGE_DELAY_S if asked < replicas and not hedged else None
                done, _ = await asyncio.wait(pending, timeout=hedge, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    hedged = True  # the replicas asked so far are slow: ask the next one too, budget permitting
                    if self._hedges.spend():  # (else their timeouts hand over)
                        ask()
                    continue
                decided = [call for call in done if call.exception() is None]
                if decided:  # a decision wins over whatever else came back with it (a 429 too)
                    winner = min(decided, key=pending.__getitem__)  # of those, the replica asked first
                    won = pending[winner]
                    for call in done:
                        k = pending.pop(call)
                        if call is not winner:  # it answered: not slow, but it may have routed the request too
                            self.routers[order[k]].cancel_route(attempt)
                    router, decision = self.routers[order[won]], winner.result()
                    if decision.note is not None:  # the other replicas count it too (sent after the cancels)
                        self.reports.note(router, decision.note)
                    return router, decision
                for call in done:
                    j = order[pending.pop(call)]
                    try:
                        call.result()
                    except (TimeoutError, RayActorError):
                        self._router_failed_at[j] = time.monotonic()
                        self.routers[j].cancel_route(attempt)  # in case it did route it
                    except RayError as exc:
                        cause = remote_cause(exc)
                        if isinstance(cause, Overloaded):
                            raise err(429, f"overloaded: {cause}; retry shortly", api) from None
                        no_group = str(cause) if isinstance(cause, NoGroup) else type(exc).__name__
                if asked < replicas:
                    ask()  # what came back were failures: the next replica, without waiting
        finally:
            # The others asked (all of them when the client left or no decision came): they may have routed the
            # request, so they cancel it. One asked before the winner and still silent is slow or dead (a killed
            # replica holds calls until Ray has restarted it): it is tried last for a while.
            for call, k in pending.items():
                call.cancel()
                call.add_done_callback(lambda c: c.cancelled() or c.exception())  # its late failure is expected
                self.routers[order[k]].cancel_route(attempt)
                if won is not None and k < won:
                    self._router_failed_at[order[k]] = time.monotonic()
        if no_group is not None:
            raise err(503, f"no worker group available ({no_group}); retry shortly", api)
        raise err(503, "no router replica is available; retry shortly", api, ROUTER_RETRY_AFTER_S)
