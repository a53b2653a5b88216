"""Liveness and readiness of a gateway replica, at the root of its port, without authentication and without a
tenant's name in any answer:

    GET /health   liveness: this replica's process serves HTTP                 200 {"status": "ok"}
    GET /ready    readiness: it can serve a request now                        200 {"status": "ready"}
                                                                                503 {"status": "not ready",
                                                                                     "reasons": [...]}

Ready means: Redis answers a ping; a router replica answers and knows at least one worker group (its index is
built from the groups' events); and at least one of those groups' leaders answered a health question as healthy
within the last ``READY_WINDOW_S``. Every question has a timeout of ``PROBE_TIMEOUT_S`` (a probe takes about two of
them at worst, never longer), and one probe's answer serves the ``/ready`` requests of the next ``CACHE_S``: probes
from many load balancers cost one round of questions per second. (``/-/healthz``, the older liveness path, stays.)

The admin API's ``/admin/v1/status`` (router/gateway/admin.py) reports the same facts in more detail."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

from router.clients import RouterClient
from worker.group_client import GroupClient

READY_WINDOW_S = 5.0  # a group that answered this recently counts
PROBE_TIMEOUT_S = 1.0  # each question of a probe: Redis's ping, a router replica's groups, a group's health
CACHE_S = 1.0  # a probe's answer holds this long
NO_STORE = {"Cache-Control": "no-store"}


async def _bounded(awaitable: Any, timeout_s: float = PROBE_TIMEOUT_S) -> Any:
    return await asyncio.wait_for(awaitable, timeout_s)


class Health:
    """One replica's probes. ``redis``: its Redis client; ``routers``: the router replicas."""

    def __init__(self, redis: Any, routers: Sequence[RouterClient]) -> None:
        self.redis, self.routers = redis, [RouterClient.of(r) for r in routers]
        self._answered: dict[str, tuple[Any, float]] = {}  # group -> (its leader, when it last answered healthy)
        self._reasons: list[str] = []
        self._at = -math.inf
        self._probe: asyncio.Future | None = None

    # -- the facts ---------------------------------------------------------------------------------------------

    async def redis_state(self) -> dict[str, Any]:
        """Whether Redis answers a ping within ``PROBE_TIMEOUT_S``, and how long the answer took."""
        start = time.perf_counter()
        try:
            await _bounded(self.redis.ping())
        except Exception as exc:
            return {"reachable": False, "latency_ms": None, "error": type(exc).__name__}
        return {"reachable": True, "latency_ms": round((time.perf_counter() - start) * 1000, 2)}

    async def router_states(self) -> list[dict[str, Any]]:
        """Each router replica: the groups it routes to (with their leaders, under ``leaders``: not for JSON), or
        that it did not answer."""

        async def ask(router: RouterClient) -> dict[str, Any]:
            try:
                leaders = await _bounded(router.leaders_now())
            except Exception as exc:  # dead, restarting, stuck, or no replica at all
                return {"answered": False, "error": type(exc).__name__}
            return {"answered": True, "groups": sorted(leaders), "leaders": leaders}

        return list(await asyncio.gather(*(ask(r) for r in self.routers)))

    async def _group_answers(self, leaders: dict[str, Any]) -> None:
        async def ping(group: str, leader: Any) -> None:
            try:
                healthy = await GroupClient(group, leader).ahealth(PROBE_TIMEOUT_S) is None
            except Exception:  # dead, restarting, or not answering in time
                return
            if healthy:
                self._answered[group] = (leader, time.monotonic())

        await asyncio.gather(*(ping(g, leader) for g, leader in leaders.items()))
        for g in set(self._answered) - set(leaders):  # groups gone since
            del self._answered[g]

    def _fresh(self, leaders: dict[str, Any]) -> list[str]:
        """The groups whose current leader answered within ``READY_WINDOW_S``."""
        now = time.monotonic()
        return [
            g
            for g, leader in leaders.items()
            if (a := self._answered.get(g)) is not None and a[0] == leader and now - a[1] <= READY_WINDOW_S
        ]

    async def _check(self) -> list[str]:
        redis, routers = await asyncio.gather(self.redis_state(), self.router_states())
        reasons = []
        if not redis["reachable"]:
            reasons.append(f"redis does not answer ({redis['error']})")
        answered = [r for r in routers if r["answered"]]
        if not answered:
            reasons.append("no router replica answers")
            return reasons
        leaders: dict[str, Any] = {}
        for r in answered:
            leaders.update(r["leaders"])
        if not leaders:
            reasons.append("no worker group is serving (the router knows none)")
            return reasons
        await self._group_answers(leaders)
        if not self._fresh(leaders):
            reasons.append(f"no worker group answered within the last {READY_WINDOW_S:g} s")
        return reasons

    async def reasons(self) -> list[str]:
        """Why this replica is not ready (empty: ready), from a probe at most ``CACHE_S`` old; concurrent callers
        share one probe."""
        if time.monotonic() - self._at < CACHE_S:
            return list(self._reasons)
        if self._probe is None:
            self._probe = asyncio.ensure_future(self._check())
            self._probe.add_done_callback(self._probed)
        try:
            return list(await asyncio.shield(self._probe))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in a probe must not take the endpoint down
            return [f"the readiness check failed ({type(exc).__name__})"]

    def _probed(self, probe: asyncio.Future) -> None:
        self._probe = None
        if not probe.cancelled() and probe.exception() is None:
            self._reasons, self._at = probe.result(), time.monotonic()

    # -- the endpoints -----------------------------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        """Liveness: this replica answers."""
        return JSONResponse({"status": "ok"}, headers=NO_STORE)

    async def ready(self) -> JSONResponse:
        """Readiness (see the module's docstring): 200, or 503 with the reasons."""
        reasons = await self.reasons()
        if reasons:
            return JSONResponse(
                {"status": "not ready", "reasons": reasons}, status_code=503, headers={**NO_STORE, "Retry-After": "1"}
            )
        return JSONResponse({"status": "ready"}, headers=NO_STORE)
