"""The operator's HTTP API (a Ray Serve deployment under ``/admin``), deployed only when the config lists
``admin_keys``; tenant keys never open it. ``kvgrid scale`` and ``kvgrid groups`` are its clients.

    GET  /admin/v1/groups                      the worker groups (state, ranks, load); index keys per group, per
                                               router replica
    POST /admin/v1/scale   {"groups": N, "remove": ["g1"], "drain_timeout_s": 120}
    POST /admin/v1/match   {"tenant": "acme", "token_ids": [...]}   leading blocks each group holds
    GET  /admin/v1/metrics                     Prometheus gauges of every worker group (load, blocks)

Group load is operator data: it moves with every tenant's traffic, so no tenant endpoint shows it.
"""

# No "from __future__ import annotations": FastAPI must see real types.

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.exceptions import RayError

from router.store import hash_api_key

admin_app = FastAPI(title="kvgrid admin")


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    groups: int = Field(ge=1)
    remove: list[str] = []
    drain_timeout_s: float | None = Field(None, gt=0)


class MatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str
    token_ids: list[int]


class _AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@admin_app.exception_handler(_AdminError)
async def _admin_error(_: Request, exc: _AdminError) -> JSONResponse:
    return JSONResponse({"error": {"message": exc.message, "code": exc.status}}, status_code=exc.status)


def _presented_key(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key", "")


async def _parse(request: Request, model: type[BaseModel]):
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        first = exc.errors()[0]
        raise _AdminError(400, f"{'.'.join(str(p) for p in first['loc']) or 'body'}: {first['msg']}") from None


def _remote_error(exc: RayError) -> _AdminError:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ValueError):
        return _AdminError(400, str(cause))
    return _AdminError(500, f"{type(cause or exc).__name__}: {cause or exc}")


_GAUGES = [  # (name, help, EngineStats field)
    ("kvgrid_group_running", "Requests running on the group", "running"),
    ("kvgrid_group_waiting", "Requests waiting on the group", "waiting"),
    ("kvgrid_group_queued_prefill_tokens", "Queued prefill tokens", "queued_prefill_tokens"),
    ("kvgrid_group_free_blocks", "Free KV blocks", "blocks_free"),
    ("kvgrid_group_cached_blocks", "Cached (evictable) KV blocks", "blocks_cached"),
    ("kvgrid_group_pinned_blocks", "Pinned KV blocks", "blocks_pinned"),
]


# Serve captures this class when it is decorated: every module-level name it uses must be defined above.
@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(admin_app)
class Admin:
    def __init__(self, key_hashes: list[str], tenants: list[str], supervisor, routers: list) -> None:
        self.key_hashes = list(key_hashes)  # SHA-256 of the admin keys; the keys themselves are not kept
        self.tenants = set(tenants)
        self.supervisor, self.routers = supervisor, list(routers)
        self.registry = CollectorRegistry()
        self.gauges = [(Gauge(name, doc, ["group"], registry=self.registry), field) for name, doc, field in _GAUGES]

    def _auth(self, request: Request) -> None:
        presented = hash_api_key(_presented_key(request))
        ok = False
        for h in self.key_hashes:  # compare with every key, in constant time each
            ok |= hmac.compare_digest(h, presented)
        if not ok:
            raise _AdminError(401, "invalid admin key")

    @admin_app.get("/v1/groups")
    async def groups(self, request: Request):
        self._auth(request)
        return {"groups": await self.supervisor.describe.remote(),
                "index_keys": [await r.index_key_counts.remote() for r in self.routers]}  # per router replica

    @admin_app.post("/v1/scale")
    async def scale(self, request: Request):
        self._auth(request)
        body: ScaleRequest = await _parse(request, ScaleRequest)
        try:
            groups = await self.supervisor.scale.remote(body.groups, body.remove, body.drain_timeout_s)
        except RayError as exc:
            raise _remote_error(exc) from None
        return {"groups": groups}

    @admin_app.post("/v1/match")
    async def match(self, request: Request):
        self._auth(request)
        body: MatchRequest = await _parse(request, MatchRequest)
        if body.tenant not in self.tenants:
            raise _AdminError(404, f"no tenant {body.tenant!r}")
        return {"groups": await self.routers[0].match.remote(body.tenant, body.token_ids)}

    @admin_app.get("/v1/metrics")
    async def metrics(self, request: Request):
        self._auth(request)
        for gauge, _ in self.gauges:  # drained groups disappear
            gauge.clear()
        for group, leader in (await self.routers[0].leaders_now.remote()).items():
            try:
                stats = await leader.stats.remote()
            except RayError:
                continue
            for gauge, field in self.gauges:
                gauge.labels(group).set(getattr(stats, field))
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
