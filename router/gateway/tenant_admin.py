"""The admin API's tenants, keys and audit log (mounted on the admin app by router/gateway/app.py):

    GET    /admin/v1/tenants                          every tenant's name, origin and config
    POST   /admin/v1/tenants       {"name": "acme", "limits": {...}, "cache": {...}, "prices": {...}}   201
    GET    /admin/v1/tenants/{t}                      its config and keys (ids, prefixes; never a key)
    PATCH  /admin/v1/tenants/{t}   {"limits": {"requests_per_s": 5}}   any TenantConfig field but name, api_keys
    DELETE /admin/v1/tenants/{t}                      refused from then on; its cached contents etc. released,
                                                      its pins and cached blocks dropped on every group
    POST   /admin/v1/tenants/{t}/keys  {"limits": {...}, "budget": {...}}  {"id", "key", "prefix"}: the key, shown
                                               this once; its own limits and budget (both optional)
    PATCH  /admin/v1/tenants/{t}/keys/{id}  {"limits": {"requests_per_s": 2}}   its own limits or budget (null: none)
    GET    /admin/v1/tenants/{t}/keys                 ids, prefixes, created, expires
    DELETE /admin/v1/tenants/{t}/keys/{id}            revoked (401 on every replica within a second)
    POST   /admin/v1/tenants/{t}/keys/{id}/rotate  {"overlap_s": 300}   a new key; the old one works overlap_s more
    PUT    /admin/v1/tenants/{t}/adapters/{name}  {"path": "/models/acme-sql"}   a LoRA adapter added or replaced
    DELETE /admin/v1/tenants/{t}/adapters/{name}      removed (requests naming it get 404 within a second)
    GET    /admin/v1/audit?limit=100                  the admin actions, newest first

Bodies are validated as the config's TenantConfig is (the same model): malformed JSON is a 400, a bad field a 422
naming it. Every change is one MULTI in Redis with its audit entry (router/gateway/tenant_registry.py)."""

# No "from __future__ import annotations": FastAPI must see real types.

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from common.config import TenantConfig, adapter_problem
from common.tenant_config import KeyConfig
from router.gateway.admin import MAX_ADMIN_BODY_BYTES, _AdminError
from router.gateway.core import Gateway
from router.gateway.store import hash_api_key, presented_key
from router.gateway.tenant_registry import (
    Conflict,
    KeyRecord,
    NotFound,
    display,
    new_key,
    rotated,
    tenant_config,
)

log = logging.getLogger(__name__)

MAX_OVERLAP_S = 7 * 86400.0
DRAIN_S = 300.0  # how long a deleted tenant's running requests are waited for before the last cleanup
DEFAULT_OVERLAP_S = 300.0
_NOT_PATCHABLE = {"name", "api_keys"}


def _field_errors(exc: ValidationError) -> str:
    """Pydantic's errors as ``field.path: message``, never the value given."""
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]]
    return "; ".join(parts)


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``patch`` over ``base``: sections (cache, limits, ...) merged field by field; null resets a field."""
    out = dict(base)
    for k, v in patch.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _live_key(keys: dict[str, KeyRecord], tenant: str, key_id: str) -> KeyRecord:
    """``key_id``'s record among a tenant's ``keys``, if it still works; NotFound otherwise."""
    rec = keys.get(key_id)
    if rec is None or not rec.live(time.time()):
        raise NotFound(f"tenant {tenant!r} has no key {key_id!r}")
    return rec


class TenantAdmin:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.registry = gw.tenant_sync.registry

    # -- helpers -------------------------------------------------------------------------------------------------

    def _auth(self, request: Request, action: str, tenant: str = "") -> dict[str, Any]:
        """Check the admin key; the audit entry of this action (who, what, when, from where)."""
        key = presented_key(request.headers)
        if not key or not self.gw.keys.authenticate("admin", key):
            raise _AdminError(401, "invalid admin key")
        self.gw.tenant_sync.start()
        return {
            "at": f"{time.time():.3f}",
            "admin": "admin-" + hash_api_key(key)[:8],
            "admin_key": display(key),
            "from": request.client.host if request.client else "",
            "action": action,
            "tenant": tenant,
        }

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > MAX_ADMIN_BODY_BYTES:
            raise _AdminError(413, f"request body exceeds {MAX_ADMIN_BODY_BYTES} bytes")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise _AdminError(400, f"body: malformed JSON ({exc})") from None
        if not isinstance(body, dict):
            raise _AdminError(400, "body: must be a JSON object")
        return body

    async def _changed(self) -> None:
        """This replica applies its own change at once (the others within their sync interval)."""
        await self.gw.tenant_sync.refresh()

    # -- tenants -------------------------------------------------------------------------------------------------

    async def list_tenants(self, request: Request):
        self._auth(request, "tenants.list")
        return {"tenants": [await self.registry.get(n) for n in await self.registry.names()]}

    async def get_tenant(self, tenant: str, request: Request):
        self._auth(request, "tenants.get", tenant)
        try:
            return await self.registry.get(tenant)
        except NotFound as exc:
            raise _AdminError(404, str(exc)) from None

    async def create_tenant(self, request: Request):
        audit = self._auth(request, "tenants.create")
        body = await self._body(request)
        if "api_keys" in body:
            raise _AdminError(422, "api_keys: keys are made with POST /admin/v1/tenants/{name}/keys")
        if body.get("name") == "admin":
            raise _AdminError(422, "name: 'admin' is reserved (the admin API lives under /admin)")
        try:
            cfg = tenant_config(body)
        except ValidationError as exc:
            raise _AdminError(422, _field_errors(exc)) from None
        self._check_adapters(cfg)
        audit.update(tenant=cfg.name, change=body)
        try:
            await self.registry.create(cfg, audit)
        except Conflict as exc:
            raise _AdminError(409, str(exc)) from None
        await self._changed()
        log.info("tenant %s created by %s", cfg.name, audit["admin"])
        return JSONResponse(await self.registry.get(cfg.name), status_code=201)

    async def update_tenant(self, tenant: str, request: Request):
        audit = self._auth(request, "tenants.update", tenant)
        body = await self._body(request)
        bad = sorted(set(body) & _NOT_PATCHABLE - ({"name"} if body.get("name") == tenant else set()))
        if bad:
            raise _AdminError(422, f"{bad[0]}: cannot be changed here (keys: /admin/v1/tenants/{{name}}/keys)")
        audit["change"] = body

        def change(stored: dict[str, Any]) -> TenantConfig:
            merged = _merge(stored, body)
            if isinstance(merged.get("adapters"), dict):  # null removes an adapter
                merged["adapters"] = {k: v for k, v in merged["adapters"].items() if v is not None}
            return self._check_adapters(tenant_config(merged))

        await self._update(tenant, change, audit)
        log.info("tenant %s updated by %s", tenant, audit["admin"])
        return await self.registry.get(tenant)

    def _check_adapters(self, cfg: TenantConfig) -> TenantConfig:
        """422 naming the adapter whose folder this gateway cannot serve (or whose name is the base model's)."""
        problem = adapter_problem(cfg, self.gw.model_id, self.gw.config.lora.max_lora_rank)
        if problem is not None:
            raise _AdminError(422, problem)
        return cfg

    async def _update(self, tenant: str, change, audit: dict[str, Any]) -> None:
        """Apply ``change`` (stored config -> new TenantConfig) to ``tenant`` in the registry, with ``audit``."""
        try:
            await self.registry.update(tenant, change, audit)
        except NotFound as exc:
            raise _AdminError(404, str(exc)) from None
        except ValidationError as exc:
            raise _AdminError(422, _field_errors(exc)) from None
        await self._changed()

    # -- adapters ------------------------------------------------------------------------------------------------

    async def put_adapter(self, tenant: str, name: str, request: Request):
        audit = self._auth(request, "adapters.put", tenant)
        body = await self._body(request)
        unknown = sorted(set(body) - {"path"})
        if unknown:
            raise _AdminError(422, f"{unknown[0]}: unknown field (only path)")
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise _AdminError(422, "path: the adapter's PEFT folder, as a string")
        audit.update(adapter=name, path=path)

        def change(stored: dict[str, Any]) -> TenantConfig:
            return self._check_adapters(
                tenant_config({**stored, "adapters": {**stored.get("adapters", {}), name: path}})
            )

        await self._update(tenant, change, audit)
        log.info("adapter %s of tenant %s set to %s by %s", name, tenant, path, audit["admin"])
        return {"tenant": tenant, "adapters": (await self.registry.get(tenant))["config"].get("adapters", {})}

    async def delete_adapter(self, tenant: str, name: str, request: Request):
        audit = self._auth(request, "adapters.delete", tenant)
        audit["adapter"] = name

        def change(stored: dict[str, Any]) -> TenantConfig:
            adapters = dict(stored.get("adapters", {}))
            if adapters.pop(name, None) is None:
                raise NotFound(f"tenant {tenant!r} has no adapter {name!r}")
            return tenant_config({**stored, "adapters": adapters})

        await self._update(tenant, change, audit)
        log.info("adapter %s of tenant %s removed by %s", name, tenant, audit["admin"])
        return {"deleted": name, "tenant": tenant}

    async def delete_tenant(self, tenant: str, request: Request):
        audit = self._auth(request, "tenants.delete", tenant)
        t = self.gw.tenants.get(tenant)  # this replica's state of it: its requests in flight here
        try:
            await self.registry.delete(tenant, audit)
        except NotFound as exc:
            raise _AdminError(404, str(exc)) from None
        await self._changed()
        try:  # best effort: what is left expires with its TTL
            released: int | None = await self.registry.release(tenant)
        except Exception as exc:
            log.warning("tenant %s deleted; releasing its Redis keys failed: %s", tenant, exc)
            released = None
        # The groups release its pins and forget its cached blocks (the routers' indexes drop them with the
        # events), so a tenant made again under the name starts cold; once its requests here have ended, again.
        groups = await self.gw.pool.forget_tenant(tenant)
        if t is not None and t.inflight:
            self.gw.accounting.spawn(self._forget_when_drained(t))
        log.info("tenant %s deleted by %s (%s Redis keys released)", tenant, audit["admin"], released)
        return {"deleted": tenant, "released_redis_keys": released, "groups": groups}

    async def _forget_when_drained(self, t: Any) -> None:
        """Once a deleted tenant's requests in this replica have ended (or ``DRAIN_S`` passed), forget what they
        left cached."""
        deadline = time.monotonic() + DRAIN_S
        while t.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await self.gw.pool.forget_tenant(t.name)

    # -- keys ----------------------------------------------------------------------------------------------------

    def _key_config(self, body: dict[str, Any]) -> dict[str, Any]:
        """A key's own limits and budget from a request body (``KeyConfig``), as stored; 422 naming a bad field."""
        try:
            cfg = KeyConfig.model_validate(body)
        except ValidationError as exc:
            raise _AdminError(422, _field_errors(exc)) from None
        return cfg.model_dump(mode="json", exclude_none=True)

    async def create_key(self, tenant: str, request: Request):
        audit = self._auth(request, "keys.create", tenant)
        own = self._key_config(await self._body(request))  # {"limits": {...}, "budget": {...}}, both optional
        key = new_key()
        rec = replace(KeyRecord.make(hash_api_key(key), display(key)), **own)
        audit.update(key_id=rec.id, **own)
        await self._change_keys(tenant, lambda _: [rec], audit)
        return JSONResponse({"id": rec.id, "key": key, "prefix": rec.prefix, "tenant": tenant, **own}, status_code=201)

    async def update_key(self, tenant: str, key_id: str, request: Request):
        """Replace a key's own limits and/or budget (a field given as null removes it)."""
        audit = self._auth(request, "keys.update", tenant)
        body = await self._body(request)
        own = self._key_config({k: v for k, v in body.items() if v is not None})
        audit.update(key_id=key_id, change=body)

        def change(keys: dict[str, KeyRecord]) -> list[KeyRecord]:
            rec = _live_key(keys, tenant, key_id)
            fields = {k: own.get(k, getattr(rec, k)) for k in ("limits", "budget")}
            fields.update({k: None for k, v in body.items() if v is None and k in fields})
            return [replace(rec, **fields)]

        await self._change_keys(tenant, change, audit)
        return next(k for k in (await self.registry.get(tenant))["keys"] if k["id"] == key_id)

    async def _change_keys(self, tenant: str, change, audit: dict[str, Any]) -> None:
        """Apply ``change`` (the tenant's keys -> records to set and ids to drop) in the registry, with ``audit``;
        404 for an unknown tenant or key."""
        try:
            await self.registry.change_keys(tenant, change, audit)
        except NotFound as exc:
            raise _AdminError(404, str(exc)) from None
        await self._changed()

    async def list_keys(self, tenant: str, request: Request):
        self._auth(request, "keys.list", tenant)
        try:
            return {"keys": (await self.registry.get(tenant))["keys"]}
        except NotFound as exc:
            raise _AdminError(404, str(exc)) from None

    async def revoke_key(self, tenant: str, key_id: str, request: Request):
        audit = self._auth(request, "keys.revoke", tenant)
        audit["key_id"] = key_id

        def change(keys: dict[str, KeyRecord]) -> list[str]:
            _live_key(keys, tenant, key_id)
            return [key_id]

        await self._change_keys(tenant, change, audit)
        return {"revoked": key_id}

    async def rotate_key(self, tenant: str, key_id: str, request: Request):
        audit = self._auth(request, "keys.rotate", tenant)
        body = await self._body(request)
        unknown = sorted(set(body) - {"overlap_s"})
        if unknown:
            raise _AdminError(422, f"{unknown[0]}: unknown field (only overlap_s)")
        overlap = body.get("overlap_s", DEFAULT_OVERLAP_S)
        if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0 <= overlap <= MAX_OVERLAP_S:
            raise _AdminError(422, f"overlap_s: a number of seconds from 0 to {MAX_OVERLAP_S:.0f}")
        key = new_key()
        rec = KeyRecord.make(hash_api_key(key), display(key))
        audit.update(key_id=key_id, new_key_id=rec.id, overlap_s=overlap)

        def change(keys: dict[str, KeyRecord]) -> list[KeyRecord | str]:
            old = _live_key(keys, tenant, key_id)
            # The new value carries the old one's own limits and budget (its spend starts anew: a new id).
            return [
                rotated(old, float(overlap)) if overlap > 0 else key_id,
                replace(rec, limits=old.limits, budget=old.budget),
            ]

        await self._change_keys(tenant, change, audit)
        return JSONResponse(
            {
                "id": rec.id,
                "key": key,
                "prefix": rec.prefix,
                "tenant": tenant,
                "old_id": key_id,
                "old_expires": round(time.time() + overlap, 3),
            },
            status_code=201,
        )

    # -- audit ---------------------------------------------------------------------------------------------------

    async def audit(self, request: Request, limit: int = 100):
        self._auth(request, "audit.read")
        if not 1 <= limit <= 10_000:
            raise _AdminError(422, "limit: from 1 to 10000")
        return {"entries": await self.registry.audit(limit)}


def mount_admin(admin: FastAPI, gw: Gateway) -> TenantAdmin:
    """The tenants, keys and audit routes on the admin app; the admin's tenant check (/v1/match) follows the
    registry."""
    api = TenantAdmin(gw)
    for path, handler, method in (
        ("/v1/tenants", api.list_tenants, "GET"),
        ("/v1/tenants", api.create_tenant, "POST"),
        ("/v1/tenants/{tenant}", api.get_tenant, "GET"),
        ("/v1/tenants/{tenant}", api.update_tenant, "PATCH"),
        ("/v1/tenants/{tenant}", api.delete_tenant, "DELETE"),
        ("/v1/tenants/{tenant}/keys", api.create_key, "POST"),
        ("/v1/tenants/{tenant}/keys", api.list_keys, "GET"),
        ("/v1/tenants/{tenant}/keys/{key_id}", api.revoke_key, "DELETE"),
        ("/v1/tenants/{tenant}/keys/{key_id}", api.update_key, "PATCH"),
        ("/v1/tenants/{tenant}/keys/{key_id}/rotate", api.rotate_key, "POST"),
        ("/v1/tenants/{tenant}/adapters/{name}", api.put_adapter, "PUT"),
        ("/v1/tenants/{tenant}/adapters/{name}", api.delete_adapter, "DELETE"),
        ("/v1/audit", api.audit, "GET"),
    ):
        admin.add_api_route(path, handler, methods=[method])
    owner = getattr(admin.state, "admin", None)
    if owner is not None:
        owner.tenants = gw.tenants  # a live view: tenants created or deleted at run time count
    return api
