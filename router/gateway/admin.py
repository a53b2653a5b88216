"""The operator's HTTP API (under ``/admin`` of every gateway replica), deployed only when the config lists
``admin_keys``; tenant keys never open it. ``kvgrid scale`` and ``kvgrid groups`` are its clients.

    GET  /admin/v1/groups                      the worker groups (state, ranks, load); index keys per group, per
                                               router replica; the supervisor's and each replica's process
    GET  /admin/v1/status                      at once: each group's state, each router replica's, the gateway
                                               replicas', Redis's (reachable, latency), this replica's readiness
    POST /admin/v1/scale   {"groups": N, "remove": ["g1"], "drain_timeout_s": 120}
    POST /admin/v1/match   {"tenant": "acme", "token_ids": [...]}   leading blocks each group holds
    GET  /admin/v1/metrics                     Prometheus gauges of every worker group (load, blocks), and
                                               every tenant's usage ledger counters (router/gateway/usage_api.py)
    GET  /admin/v1/usage, /admin/v1/alerts     every tenant's usage and cost; hit-rate drop alerts (usage_api.py)

Group load is operator data: it moves with every tenant's traffic, so no tenant endpoint shows it.
"""

# No "from __future__ import annotations": FastAPI must see real types.

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from ray.exceptions import RayActorError, RayError

from common.errors import remote_cause
from router.clients import RouterClient, SupervisorClient
from router.gateway.health import Health
from router.gateway.routes import Routes
from router.gateway.store import KeyRing, presented_key
from router.gateway.wire import BodyError, parse_body
from worker.group_client import GroupClient

CALL_TIMEOUT_S = 30.0  # reads of the supervisor, routers and groups
DESCRIBE_TIMEOUT_S = 120.0  # the supervisor asks every group in turn (each bounded by its own timeouts)
SCALE_TIMEOUT_S = 3600.0  # a scale waits for groups to start and drain (each bounded by the supervisor)
STATUS_TIMEOUT_S = 5.0  # each question of /v1/status
GATEWAY_DEPLOYMENT = "kvgrid-gateway"  # router/control/serve.py names the gateway's Serve deployment so

routes = Routes()  # the admin endpoints, bound to one Admin by create_admin_app


# Strict: an operator's typo must not scale the cluster (``{"groups": true}`` would otherwise mean 1 group).
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_ADMIN_BODY_BYTES = 4 * 2**20


class ScaleRequest(BaseModel):
    model_config = _STRICT
    groups: int = Field(ge=1, le=1024)
    remove: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=64)
    drain_timeout_s: float | None = Field(None, gt=0, le=3600)


class MatchRequest(BaseModel):
    model_config = _STRICT
    tenant: str = Field(min_length=1, max_length=256)
    token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(max_length=2**20)


class _AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def _admin_error(_: Request, exc: _AdminError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None  # the cluster is restarting: retry
    return JSONResponse(
        {"error": {"message": exc.message, "code": exc.status}}, status_code=exc.status, headers=headers
    )


async def _parse(request: Request, model: type[BaseModel]):
    try:
        return await parse_body(request, model, MAX_ADMIN_BODY_BYTES)
    except BodyError as exc:
        raise _AdminError(exc.status, exc.message) from None


def _remote_error(exc: BaseException) -> _AdminError:
    if isinstance(exc, (RayActorError, asyncio.TimeoutError)):  # restarting, or not answering: retry later
        return _AdminError(503, f"the cluster did not answer ({type(exc).__name__}); retry shortly")
    cause = remote_cause(exc)
    if isinstance(cause, ValueError):
        return _AdminError(400, str(cause))
    return _AdminError(500, f"{type(cause or exc).__name__}: {cause or exc}")


T = TypeVar("T")


async def _call(ref: Awaitable[T], timeout_s: float = CALL_TIMEOUT_S) -> T:
    """The result of a remote call, or the matching admin error (never a wait without end)."""
    try:
        return await asyncio.wait_for(ref, timeout_s)
    except (TimeoutError, RayError) as exc:
        raise _remote_error(exc) from None


_GAUGES = [  # (name, help, EngineStats field)
    ("kvgrid_group_running", "Requests running on the group", "running"),
    ("kvgrid_group_waiting", "Requests waiting on the group", "waiting"),
    ("kvgrid_group_queued_prefill_tokens", "Queued prefill tokens", "queued_prefill_tokens"),
    ("kvgrid_group_free_blocks", "Free KV blocks", "blocks_free"),
    ("kvgrid_group_cached_blocks", "Cached (evictable) KV blocks", "blocks_cached"),
    ("kvgrid_group_pinned_blocks", "Pinned KV blocks", "blocks_pinned"),
    ("kvgrid_group_computed_tokens", "Tokens the group's model has computed, prefill and decode", "computed_tokens"),
    # KV tiers (worker/kv_tiers.py): blocks held in host RAM and on disk, blocks hit there, and what loading cost.
    ("kvgrid_group_host_blocks", "KV blocks held in host RAM", "host_blocks"),
    ("kvgrid_group_disk_blocks", "KV blocks held on disk", "disk_blocks"),
    ("kvgrid_group_host_hit_blocks", "KV blocks loaded from host RAM instead of computed", "host_hit_blocks"),
    ("kvgrid_group_disk_hit_blocks", "KV blocks read from disk instead of computed", "disk_hit_blocks"),
    ("kvgrid_group_tier_load_bytes", "Bytes of KV loaded from host RAM and disk", "tier_load_bytes"),
    ("kvgrid_group_tier_load_seconds", "Seconds spent loading KV from host RAM and disk", "tier_load_seconds"),
    # The engine's steps: seconds in them over wall time is how busy the group's engine is; their wall time well
    # over their CPU time, how long its steps waited for a core.
    ("kvgrid_group_steps", "Engine steps that computed a batch", "steps"),
    ("kvgrid_group_step_seconds", "Wall seconds spent in engine steps", "step_seconds"),
    ("kvgrid_group_step_cpu_seconds", "CPU seconds of the engine thread in its steps", "step_cpu_seconds"),
]


class Admin:
    """``keys`` holds the admin keys' hashes under the name ``admin`` (``KeyRing.from_config``)."""

    def __init__(
        self,
        keys: KeyRing,
        tenants: list[str],
        supervisor: SupervisorClient,
        routers: Sequence[RouterClient],
        docs: bool = False,
        health: Health | None = None,
    ) -> None:
        self.keys = keys
        self.tenants = set(tenants)
        self.supervisor, self.routers = SupervisorClient.of(supervisor), [RouterClient.of(r) for r in routers]
        self.health = health  # the replica's probes (router/gateway/health.py), for /v1/status
        self.started = time.time()
        self.docs_on = docs
        self.registry = CollectorRegistry()
        self.gauges = [(Gauge(name, doc, ["group"], registry=self.registry), field) for name, doc, field in _GAUGES]
        # More series for /v1/metrics, in Prometheus's text format (the tenants' usage ledger: usage_api.py).
        self.extra_metrics: list[Callable[[], Awaitable[bytes]]] = []

    def _auth(self, request: Request) -> None:
        if not self.keys.authenticate("admin", presented_key(request.headers)):
            raise _AdminError(401, "invalid admin key")

    async def _ask_router(self, ask: Callable[[RouterClient], Awaitable[T]]) -> T:
        """Ask the first router replica that answers (a dead or restarting one is skipped)."""
        last: BaseException | None = None
        for router in self.routers:
            try:
                return await asyncio.wait_for(ask(router), CALL_TIMEOUT_S)
            except (TimeoutError, RayActorError) as exc:
                last = exc
            except RayError as exc:
                raise _remote_error(exc) from None
        if last is None:  # no router replica at all
            raise _AdminError(503, "no router replica is available; retry shortly")
        raise _remote_error(last) from None

    @routes.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        if not self.docs_on:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse(request.app.openapi())

    @routes.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        if not self.docs_on:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return get_swagger_ui_html(
            openapi_url=request.scope.get("root_path", "") + "/openapi.json", title="kvgrid admin"
        )

    @routes.get("/v1/groups")
    async def groups(self, request: Request):
        self._auth(request)
        index_keys: list[dict[str, int] | None] = []  # per router replica; one that does not answer shows as null
        for r in self.routers:
            try:
                index_keys.append(await asyncio.wait_for(r.index_key_counts(), CALL_TIMEOUT_S))
            except (TimeoutError, RayError):
                index_keys.append(None)
        routers: list[dict | None] = []  # each replica's process (a new pid after Ray restarted it); null if silent
        router_groups: list[dict | None] = []  # each replica's view of the groups: paused, index keys, its load
        for r in self.routers:
            for out, call in ((routers, r.info), (router_groups, r.groups)):
                try:
                    out.append(await asyncio.wait_for(call(), CALL_TIMEOUT_S))
                except (TimeoutError, RayError):
                    out.append(None)
        return {
            "groups": await _call(self.supervisor.describe(), DESCRIBE_TIMEOUT_S),
            "index_keys": index_keys,
            "supervisor": await _call(self.supervisor.info()),
            "routers": routers,
            "router_groups": router_groups,
        }

    @routes.get("/v1/status")
    async def status(self, request: Request):
        """Every group's state (the supervisor's), each router replica's and this gateway replica's, the gateway
        deployment's replicas (Serve's view), Redis's, and this replica's readiness (``/ready``'s reasons). Each
        question has its own timeout: a part that does not answer shows as such, the rest still does."""
        self._auth(request)
        health = self.health

        async def supervisor() -> dict:
            try:
                return {"answered": True, **await asyncio.wait_for(self.supervisor.status(), STATUS_TIMEOUT_S)}
            except Exception as exc:  # restarting (Ray restarts it), or busy
                return {"answered": False, "error": type(exc).__name__}

        async def routers() -> list[dict]:
            if health is not None:
                return [{k: v for k, v in r.items() if k != "leaders"} for r in await health.router_states()]
            return []

        async def redis() -> dict | None:
            return None if health is None else await health.redis_state()

        async def ready() -> list[str] | None:
            return None if health is None else await health.reasons()

        sup, rts, red, reasons, gateways = await asyncio.gather(supervisor(), routers(), redis(), ready(), _gateways())
        return {
            "ready": reasons == [] if reasons is not None else None,
            "reasons": reasons,
            "groups": sup.pop("groups", None),
            "supervisor": sup,
            "routers": rts,
            "gateway": {"pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1), "deployment": gateways},
            "redis": red,
        }

    @routes.post("/v1/scale")
    async def scale(self, request: Request):
        self._auth(request)
        body: ScaleRequest = await _parse(request, ScaleRequest)
        groups = await _call(self.supervisor.scale(body.groups, body.remove, body.drain_timeout_s), SCALE_TIMEOUT_S)
        return {"groups": groups}

    @routes.post("/v1/match")
    async def match(self, request: Request):
        self._auth(request)
        body: MatchRequest = await _parse(request, MatchRequest)
        if body.tenant not in self.tenants:
            raise _AdminError(404, f"no tenant {body.tenant!r}")
        return {"groups": await self._ask_router(lambda r: r.match(body.tenant, body.token_ids))}

    @routes.get("/v1/metrics")
    async def metrics(self, request: Request):
        self._auth(request)
        for gauge, _ in self.gauges:  # drained groups disappear
            gauge.clear()
        for group, leader in (await self._ask_router(RouterClient.leaders_now)).items():
            try:
                stats = await GroupClient(group, leader).astats(CALL_TIMEOUT_S)
            except Exception:  # gone, not answering, or failing: no gauges for it, the others still show
                continue
            for gauge, field in self.gauges:
                gauge.labels(group).set(getattr(stats, field))
        text = generate_latest(self.registry) + b"".join([await extra() for extra in self.extra_metrics])
        return Response(text, media_type=CONTENT_TYPE_LATEST)


async def _gateways() -> dict:
    """The gateway deployment's state and its replicas' states as Serve's controller knows them."""

    def read() -> dict:
        from ray import serve

        for app in serve.status().applications.values():
            for name, d in app.deployments.items():
                if name == GATEWAY_DEPLOYMENT:
                    return {
                        "status": _enum_name(d.status),
                        "replicas": {_enum_name(k): v for k, v in d.replica_states.items()},
                    }
        return {"status": "unknown"}

    try:
        return await asyncio.wait_for(asyncio.to_thread(read), STATUS_TIMEOUT_S)
    except Exception as exc:  # Serve's controller is restarting, or this is no Serve replica (tests)
        return {"status": "unknown", "error": type(exc).__name__}


def create_admin_app(admin: Admin) -> FastAPI:
    """The admin API's ASGI app (the gateway mounts it under ``/admin``)."""
    app = FastAPI(title="kvgrid admin", docs_url=None, redoc_url=None, openapi_url=None)
    # Starlette types a handler as taking any Exception; it calls this one only with an _AdminError.
    app.add_exception_handler(_AdminError, _admin_error)  # type: ignore[arg-type]
    app.state.admin = admin
    routes.include(app, admin)
    return app


def _enum_name(value: Any) -> str:
    """Serve's status enums as their names (``HEALTHY``, ``RUNNING``), not ``DeploymentStatus.HEALTHY``."""
    return str(getattr(value, "value", value))
