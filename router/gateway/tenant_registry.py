"""The tenants and their API keys at run time, in Redis (``TenantRegistry``), shared by every gateway replica.

    kvgrid:tenants               hash: name -> {"config": TenantConfig without api_keys, "origin", "updated"}
    kvgrid:tenant-keys:{name}    hash: key id -> a ``KeyRecord`` (a salted hash and a display form, never the key)
    kvgrid:tenants:deleted       set: names deleted through the API (a restart's config does not bring them back)
    kvgrid:tenants:version       counter: raised by every change; each replica polls it (router/gateway/tenant_sync.py)
    kvgrid:audit                 stream: every admin action (router/gateway/tenant_admin.py)

The config's tenants are the initial set (``seed``, at every start). A tenant whose ``origin`` is ``config`` follows
the config: at a restart it is rewritten from it (and removed when the config no longer has it). Any change through
the API (update, a key created, revoked or rotated) makes it ``api``: from then on Redis wins and the config's entry
for it is ignored; a tenant deleted through the API stays deleted. Every write is one MULTI (WATCH on what it read),
its audit entry included, so a failed or refused change leaves nothing behind."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import redis
import redis.asyncio

from common.config import TenantConfig
from router.gateway.store import KeyRing, _Backed, hash_api_key

REGISTRY_KEY = "kvgrid:tenants"
DELETED_KEY = "kvgrid:tenants:deleted"
VERSION_KEY = "kvgrid:tenants:version"
AUDIT_KEY = "kvgrid:audit"
AUDIT_MAXLEN = 10_000  # entries kept (approximately: MAXLEN ~)
_PLACEHOLDER_KEY = "-" * 8  # TenantConfig wants api_keys; the registry keeps them apart, as KeyRecords


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def keys_key(name: str) -> str:
    return f"kvgrid:tenant-keys:{name}"


class NotFound(Exception):
    """No such tenant, or no such key of it."""


class Conflict(Exception):
    """The tenant exists already."""


def tenant_config(stored: Mapping[str, Any]) -> TenantConfig:
    """A stored config (no api_keys) as a TenantConfig, validated, with an empty key list like the gateway's own
    (router/control/serve.py hands the gateway its config without keys)."""
    cfg = TenantConfig.model_validate({**stored, "api_keys": [_PLACEHOLDER_KEY]})
    return cfg.model_copy(update={"api_keys": []})


def stored_config(cfg: TenantConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json", exclude={"api_keys"})


def salted(salt: str, unsalted: str) -> str:
    """What is stored of a key: SHA-256 over a per-key salt and the key's plain SHA-256 (``hash_api_key``), so the
    config's keys, of which the gateway only ever holds the plain hash, are stored the same way."""
    return hashlib.sha256((salt + unsalted).encode()).hexdigest()


def new_key() -> str:
    return "sk-kv-" + secrets.token_urlsafe(32)


def display(key: str) -> str:
    """The form a key is shown in after its creation: ``sk-...abcd``."""
    return f"{key[:3]}...{key[-4:]}" if len(key) >= 32 else f"...{key[-2:]}"


@dataclass(frozen=True)
class KeyRecord:
    """One API key of a tenant as stored: ``expires`` (epoch seconds) is set on a rotated key's old value."""

    id: str
    salt: str
    hash: str
    prefix: str
    created: float
    expires: float | None = None
    origin: str = "api"
    # Its own limits and budget (common/tenant_config.py KeyConfig, as JSON), within the tenant's.
    limits: dict[str, Any] | None = None
    budget: dict[str, Any] | None = None

    @classmethod
    def make(cls, unsalted: str, prefix: str, origin: str = "api", id: str | None = None) -> KeyRecord:
        salt = secrets.token_hex(16)
        kid = id or "key-" + secrets.token_hex(6)
        return cls(kid, salt, salted(salt, unsalted), prefix, round(time.time(), 3), None, origin)

    @classmethod
    def of(cls, raw: bytes | str) -> KeyRecord:
        return cls(**json.loads(raw))

    def dump(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    def live(self, now: float) -> bool:
        return self.expires is None or now < self.expires

    def public(self) -> dict[str, Any]:
        """What the admin API shows of it: never the key, nor its hash."""
        return {
            "id": self.id,
            "prefix": self.prefix,
            "created": self.created,
            "expires": self.expires,
            "origin": self.origin,
            "limits": self.limits,
            "budget": self.budget,
        }


def config_key_id(unsalted: str) -> str:
    """A config key's stable id: the same at every restart, so seeding it again changes nothing."""
    return "cfg-" + unsalted[:8]


class LiveKeys(KeyRing):
    """The replica's key check: the admin keys (and, until the registry was first read, the tenants' config keys)
    from ``base``; after that every tenant's keys as the registry holds them (``live``, swapped whole)."""

    def __init__(self, base: KeyRing) -> None:
        super().__init__({})
        self.base = base
        self.live: dict[str, list[KeyRecord]] | None = None

    def hashes(self, owner: str) -> list[str]:
        return self.base.hashes(owner)

    def authenticate(self, tenant: str, key: str | None) -> bool:
        if tenant == "admin" or self.live is None:
            return self.base.authenticate(tenant, key)
        return self.find(tenant, key) is not None

    def find(self, tenant: str, key: str | None) -> KeyRecord | None:
        """The live record of ``tenant``'s key ``key`` (None: not one, or the registry was not read yet)."""
        live = self.live
        if live is None or not key:
            return None
        unsalted, now, found = hash_api_key(key), time.time(), None
        # An unknown tenant costs a comparison too, so timing does not tell which tenants exist; every record is
        # compared, whichever matches.
        for rec in live.get(tenant) or [_NO_RECORD]:
            if hmac.compare_digest(rec.hash, salted(rec.salt, unsalted)) and rec.live(now):
                found = rec
        return found


_NO_RECORD = KeyRecord.make(hash_api_key(secrets.token_hex(32)), "")


@dataclass
class Snapshot:
    """The registry as one replica read it: each tenant's stored config (as JSON text, to compare) and keys."""

    version: int
    configs: dict[str, str]
    keys: dict[str, list[KeyRecord]]


Queue = Callable[[Any], None]  # queues a transaction's writes on the pipeline


class TenantRegistry(_Backed):
    """Reads and writes of the registry. Each write checks what it needs under WATCH, then queues its changes, the
    version's increment and its ``audit`` entry in one MULTI (retried when a watched key changed meanwhile)."""

    async def _txn(self, watch: list[str], plan: Callable[[Any], Awaitable[Queue]]) -> None:
        async def run() -> None:
            async with self.r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(*watch)
                        queue = await plan(pipe)  # raises NotFound / Conflict / ValidationError: nothing written
                        pipe.multi()
                        queue(pipe)
                        await pipe.execute()
                        return
                    except redis.WatchError:
                        continue

        await self._do(run())

    @staticmethod
    def _audit(pipe: Any, audit: Mapping[str, Any] | None) -> None:
        pipe.incr(VERSION_KEY)
        if audit is not None:
            entry = {k: v if isinstance(v, str) else json.dumps(v) for k, v in audit.items()}
            pipe.xadd(AUDIT_KEY, entry, maxlen=AUDIT_MAXLEN, approximate=True)

    @staticmethod
    def _record(cfg: Mapping[str, Any], origin: str) -> str:
        return json.dumps({"config": cfg, "origin": origin, "updated": round(time.time(), 3)})

    @staticmethod
    async def _read(pipe: Any, name: str) -> dict[str, Any]:
        raw = await pipe.hget(REGISTRY_KEY, name)
        if raw is None:
            raise NotFound(f"no tenant {name!r}")
        return json.loads(raw)

    # -- reads -----------------------------------------------------------------------------------------------------

    async def version(self) -> int:
        return int(await self._do(self.r.get(VERSION_KEY)) or 0)

    async def snapshot(self) -> Snapshot:
        async def read() -> Snapshot:
            version = int(await self.r.get(VERSION_KEY) or 0)
            rows: dict[Any, Any] = await self.r.hgetall(REGISTRY_KEY)
            names = sorted(_s(n) for n in rows)
            async with self.r.pipeline(transaction=False) as pipe:
                for n in names:
                    pipe.hgetall(keys_key(n))
                key_rows = await pipe.execute()
            configs = {_s(n): json.dumps(json.loads(v)["config"], sort_keys=True) for n, v in rows.items()}
            keys = {n: [KeyRecord.of(v) for v in kr.values()] for n, kr in zip(names, key_rows, strict=True)}
            return Snapshot(version, configs, keys)

        return await self._do(read())

    async def get(self, name: str) -> dict[str, Any]:
        """A tenant's record with its keys' public view; NotFound."""
        raw, keys = await self._do(self._get_both(name))
        if raw is None:
            raise NotFound(f"no tenant {name!r}")
        rec = json.loads(raw)
        now = time.time()
        shown = sorted((KeyRecord.of(v) for v in keys.values()), key=lambda k: k.created)
        return {
            "name": name,
            "origin": rec["origin"],
            "updated": rec["updated"],
            "config": rec["config"],
            "keys": [k.public() for k in shown if k.live(now)],
        }

    async def _get_both(self, name: str) -> tuple[Any, dict]:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hget(REGISTRY_KEY, name)
            pipe.hgetall(keys_key(name))
            raw, keys = await pipe.execute()
        return raw, keys

    async def names(self) -> list[str]:
        names: list[Any] = await self._do(self.r.hkeys(REGISTRY_KEY))
        return sorted(_s(n) for n in names)

    async def audit(self, limit: int) -> list[dict[str, Any]]:
        rows: Any = await self._do(self.r.xrevrange(AUDIT_KEY, count=limit))
        return [{"id": _s(i), **{_s(k): _s(v) for k, v in f.items()}} for i, f in rows]

    # -- writes ----------------------------------------------------------------------------------------------------

    async def create(self, cfg: TenantConfig, audit: Mapping[str, Any]) -> None:
        async def plan(pipe: Any) -> Queue:
            if await pipe.hexists(REGISTRY_KEY, cfg.name):
                raise Conflict(f"tenant {cfg.name!r} exists already")

            def queue(p: Any) -> None:
                p.hset(REGISTRY_KEY, cfg.name, self._record(stored_config(cfg), "api"))
                p.srem(DELETED_KEY, cfg.name)
                p.delete(keys_key(cfg.name))
                self._audit(p, audit)

            return queue

        await self._txn([REGISTRY_KEY], plan)

    async def update(
        self, name: str, change: Callable[[dict[str, Any]], TenantConfig], audit: Mapping[str, Any]
    ) -> TenantConfig:
        """Apply ``change`` (the stored config -> the new one, validated: it raises on bad input) to the tenant."""
        out: list[TenantConfig] = []

        async def plan(pipe: Any) -> Queue:
            cfg = change((await self._read(pipe, name))["config"])
            out[:] = [cfg]

            def queue(p: Any) -> None:
                p.hset(REGISTRY_KEY, name, self._record(stored_config(cfg), "api"))
                self._audit(p, audit)

            return queue

        await self._txn([REGISTRY_KEY], plan)
        return out[0]

    async def delete(self, name: str, audit: Mapping[str, Any]) -> None:
        async def plan(pipe: Any) -> Queue:
            await self._read(pipe, name)

            def queue(p: Any) -> None:
                p.hdel(REGISTRY_KEY, name)
                p.delete(keys_key(name))
                p.sadd(DELETED_KEY, name)
                self._audit(p, audit)

            return queue

        await self._txn([REGISTRY_KEY], plan)

    async def change_keys(
        self,
        name: str,
        change: Callable[[dict[str, KeyRecord]], Iterable[KeyRecord | str]],
        audit: Mapping[str, Any],
    ) -> None:
        """Write what ``change`` returns for the tenant's keys (by id): a KeyRecord is set, an id removed. The tenant
        becomes ``api`` (Redis wins over the config from now on); expired keys are dropped on the way."""

        async def plan(pipe: Any) -> Queue:
            rec = await self._read(pipe, name)
            keys = {k.decode(): KeyRecord.of(v) for k, v in (await pipe.hgetall(keys_key(name))).items()}
            now = time.time()
            writes = list(change(keys))
            dead = [k for k, v in keys.items() if not v.live(now)]

            def queue(p: Any) -> None:
                if dead:
                    p.hdel(keys_key(name), *dead)
                for w in writes:
                    if isinstance(w, KeyRecord):
                        p.hset(keys_key(name), w.id, w.dump())
                    else:
                        p.hdel(keys_key(name), w)
                p.hset(REGISTRY_KEY, name, self._record(rec["config"], "api"))
                self._audit(p, audit)

            return queue

        await self._txn([REGISTRY_KEY, keys_key(name)], plan)

    async def seed(self, tenants: Iterable[TenantConfig], key_hashes: Mapping[str, list[str]]) -> bool:
        """Bring the config's tenants in (see the module's doc for who wins); True if anything changed."""
        wanted = {t.name: t for t in tenants}
        changed: list[bool] = []

        async def plan(pipe: Any) -> Queue:
            rows = {n.decode(): json.loads(v) for n, v in (await pipe.hgetall(REGISTRY_KEY)).items()}
            deleted = {n.decode() for n in await pipe.smembers(DELETED_KEY)}
            writes: dict[str, tuple[str, list[KeyRecord]]] = {}
            drops = [n for n, r in rows.items() if r["origin"] == "config" and n not in wanted]
            for name, cfg in wanted.items():
                row = rows.get(name)
                if name in deleted or (row is not None and row["origin"] != "config"):
                    continue  # changed through the API: Redis wins
                have = {k.decode(): KeyRecord.of(v) for k, v in (await pipe.hgetall(keys_key(name))).items()}
                ids = {config_key_id(h): h for h in key_hashes.get(name, [])}
                if row is not None and row["config"] == stored_config(cfg) and set(have) == set(ids):
                    continue
                recs = [have[i] if i in have else KeyRecord.make(h, "(config)", "config", i) for i, h in ids.items()]
                writes[name] = (self._record(stored_config(cfg), "config"), recs)
            changed[:] = [bool(writes or drops)]

            def queue(p: Any) -> None:
                for name in drops:
                    p.hdel(REGISTRY_KEY, name)
                    p.delete(keys_key(name))
                for name, (row, recs) in writes.items():
                    p.hset(REGISTRY_KEY, name, row)
                    p.delete(keys_key(name))
                    if recs:
                        p.hset(keys_key(name), mapping={r.id: r.dump() for r in recs})
                if writes or drops:
                    p.incr(VERSION_KEY)

            return queue

        await self._txn([REGISTRY_KEY, DELETED_KEY], plan)
        return changed[0]

    async def release(self, name: str) -> int:
        """Drop a deleted tenant's cached contents, explicit entries, keep-alive records and advisor sample from
        Redis (its usage ledger stays, for billing); the number of keys removed."""
        patterns = [f"kvgrid:{p}:{name}:*" for p in ("cc", "pin", "keep", "keep-tokens")]
        exact = [f"kvgrid:{p}:{name}" for p in ("cc-index", "cc-tokens", "keep-index", "keep-alive", "advice")]

        async def run() -> int:
            gone = 0
            for pattern in patterns:
                batch: list[bytes] = []
                async for k in self.r.scan_iter(match=pattern, count=500):
                    batch.append(k)
                    if len(batch) >= 500:
                        gone += await self.r.unlink(*batch)
                        batch = []
                if batch:
                    gone += await self.r.unlink(*batch)
            return gone + await self.r.unlink(*exact)

        # A scan of a large keyspace may take longer than one call's deadline.
        return await run()


def rotated(old: KeyRecord, overlap_s: float) -> KeyRecord:
    """The old value of a rotated key: it works ``overlap_s`` more seconds (0: not at all)."""
    return replace(old, expires=round(time.time() + overlap_s, 3))
