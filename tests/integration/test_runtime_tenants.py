"""Tenants and keys at run time (router/gateway/tenant_registry.py, tenant_sync.py, tenant_admin.py): two in-process
Gateway objects on one real Redis stand for two replicas; a change made through one's admin API reaches the other
within a second; new Gateway objects on the same Redis (a restart) keep every change; no plaintext key anywhere."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import openai
import pytest

from common.config import ServeConfig
from common.outputs import FinishReason, RequestOutput
from router.gateway.admin import Admin, create_admin_app
from router.gateway.app import create_app
from router.gateway.core import Gateway
from router.gateway.generation import GenerateRequest
from router.gateway.store import KeyRing
from router.gateway.tenant_registry import AUDIT_KEY, REGISTRY_KEY, VERSION_KEY

ACME_KEY = "sk-acme-runtime-0001"
ADMIN_KEY = "sk-admin-runtime-0001"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
WITHIN_S = 1.0


class Replica:
    def __init__(self, config: ServeConfig, demo_path: str, redis_url: str) -> None:
        keys = KeyRing.from_config(config)
        self.gw = Gateway(config, keys, demo_path, [None], redis_url)
        self.gw.generation.generate = self._generate  # type: ignore[method-assign]
        admin = create_admin_app(Admin(keys, [t.name for t in config.tenants], None, []))  # type: ignore[arg-type]
        self.app = create_app(self.gw, admin)
        self.http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app), base_url="http://gw", timeout=30)

    @staticmethod
    def _generate(req: GenerateRequest):
        async def outputs():  # one token, accounted as the real generation does once it ends
            out = RequestOutput("r", req.tenant.name, req.prompt, [5], "ok", [5], "ok", True, FinishReason.STOP, 0)
            yield out, 0
            req.account(out, 0)

        return outputs()

    async def admin(self, method: str, path: str, body: Any = None, **kw: Any) -> httpx2.Response:
        if body is not None:
            kw["content"] = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return await self.http.request(method, "/admin/v1" + path, headers=ADMIN, **kw)

    async def status(self, tenant: str, key: str) -> int:
        r = await self.http.get(f"/{tenant}/v1/models", headers={"Authorization": f"Bearer {key}"})
        return r.status_code

    async def close(self) -> None:
        await self.http.aclose()
        await self.gw.close()


@pytest.fixture()
def run(demo_path, redis_client):
    """``run(test)``: ``await test(a, b, restart)`` with two replicas on the test's Redis; ``restart()`` closes them
    and answers two new ones on the same Redis."""
    url = f"unix://{redis_client.socket_file}"
    config = ServeConfig.model_validate(
        {
            "model": str(demo_path),
            "admin_keys": [ADMIN_KEY],
            "tenants": [{"name": "acme", "api_keys": [ACME_KEY]}, {"name": "globex", "api_keys": ["sk-globex-rt-01"]}],
        }
    )

    def go(test: Callable[..., Awaitable[Any]]) -> Any:
        async def main() -> Any:
            reps = [Replica(config, str(demo_path), url) for _ in range(2)]
            for r in reps:  # as the first sync round does
                await r.gw.tenant_sync.seed()
                await r.gw.tenant_sync.refresh()

            async def restart() -> tuple[Replica, Replica]:
                for r in reps:
                    await r.close()
                reps[:] = [Replica(config, str(demo_path), url) for _ in range(2)]
                for r in reps:
                    await r.gw.tenant_sync.seed()
                    await r.gw.tenant_sync.refresh()
                return reps[0], reps[1]

            try:
                return await test(reps[0], reps[1], restart)
            finally:
                for r in reps:
                    await r.close()

        return asyncio.run(asyncio.wait_for(main(), 60))

    return go


async def until(check: Callable[[], Awaitable[bool]], within_s: float = WITHIN_S) -> float:
    """Seconds until ``check()`` holds; fails past ``within_s``."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < within_s, "not seen within the limit"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def new_tenant(a: Replica, name: str = "initech") -> str:
    body = {"name": name, "limits": {"requests_per_s": 100}, "cache": {"mode": "explicit"}}
    r = await a.admin("POST", "/tenants", body)
    assert r.status_code == 201, r.text
    assert r.json()["config"]["cache"]["mode"] == "explicit" and r.json()["origin"] == "api"
    r = await a.admin("POST", f"/tenants/{name}/keys")
    assert r.status_code == 201, r.text
    return r.json()["key"]


def test_a_tenant_created_on_one_replica_serves_on_the_other_and_a_revoked_key_fails_on_both(run):
    async def test(a: Replica, b: Replica, _) -> None:
        assert await b.status("initech", "sk-nothing-yet-000") == 401
        key = await new_tenant(a)
        assert await a.status("initech", key) == 200  # the replica that made the change: at once
        await until(lambda: _is(b.status("initech", key), 200))
        # The official SDK through the new tenant, on the other replica.
        oa = openai.AsyncOpenAI(base_url="http://gw/initech/v1", api_key=key, http_client=b.http, max_retries=0)
        out = await oa.chat.completions.create(model=b.gw.model_id, messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content == "ok"
        assert b.gw.tenants["initech"].config.cache.mode == "explicit"
        # An update reaches the other replica's state in place.
        r = await a.admin("PATCH", "/tenants/initech", {"limits": {"max_inflight_requests": 3}})
        assert r.status_code == 200 and r.json()["config"]["limits"]["requests_per_s"] == 100
        await until(lambda: _now(b.gw.tenants["initech"].config.limits.max_inflight_requests == 3))
        # Revoked on A: 401 on both within a second.
        kid = (await a.admin("GET", "/tenants/initech/keys")).json()["keys"][0]["id"]
        assert (await a.admin("DELETE", f"/tenants/initech/keys/{kid}")).status_code == 200
        await until(lambda: _is(a.status("initech", key), 401))
        await until(lambda: _is(b.status("initech", key), 401))
        # Config keys are keys with ids too; deleting a tenant refuses its requests on every replica.
        keys = (await a.admin("GET", "/tenants/acme/keys")).json()["keys"]
        assert [k["origin"] for k in keys] == ["config"] and keys[0]["id"].startswith("cfg-")
        assert (await b.admin("DELETE", "/tenants/acme")).status_code == 200
        await until(lambda: _is(a.status("acme", ACME_KEY), 401))
        assert "acme" not in a.gw.tenants and "acme" not in b.gw.tenants

    run(test)


def test_a_rotated_key_works_until_the_overlap_ends(run):
    async def test(a: Replica, b: Replica, _) -> None:
        old = await new_tenant(a)
        kid = (await a.admin("GET", "/tenants/initech/keys")).json()["keys"][0]["id"]
        r = await a.admin("POST", f"/tenants/initech/keys/{kid}/rotate", {"overlap_s": 1.5})
        assert r.status_code == 201, r.text
        new, ends = r.json()["key"], r.json()["old_expires"]
        await until(lambda: _is(b.status("initech", new), 200))
        for rep in (a, b):
            assert await rep.status("initech", old) == 200  # still in its overlap
        await asyncio.sleep(max(0.0, ends - time.time()) + 0.05)
        for rep in (a, b):
            assert await rep.status("initech", old) == 401
            assert await rep.status("initech", new) == 200
        # Rotating at once (no overlap): the old value stops at once.
        kid2 = r.json()["id"]
        r = await a.admin("POST", f"/tenants/initech/keys/{kid2}/rotate", {"overlap_s": 0})
        assert await a.status("initech", new) == 401 and await a.status("initech", r.json()["key"]) == 200

    run(test)


def test_a_restart_keeps_every_change(run, redis_client):
    async def test(a: Replica, b: Replica, restart) -> None:
        key = await new_tenant(a)
        assert (await a.admin("PATCH", "/tenants/globex", {"limits": {"requests_per_s": 7}})).status_code == 200
        assert (await a.admin("DELETE", "/tenants/acme")).status_code == 200
        a, b = await restart()
        for rep in (a, b):
            assert await rep.status("initech", key) == 200
            assert await rep.status("acme", ACME_KEY) == 401  # deleted through the API: the config does not revive it
            assert await rep.status("globex", "sk-globex-rt-01") == 200  # its config key survives the update
            assert rep.gw.tenants["globex"].config.limits.requests_per_s == 7  # Redis wins for a changed tenant
        names = [t["name"] for t in (await a.admin("GET", "/tenants")).json()["tenants"]]
        assert names == ["globex", "initech"]
        # Creating it again through the API brings it back, with no keys of its own until one is made.
        assert (await a.admin("POST", "/tenants", {"name": "acme"})).status_code == 201
        assert await a.status("acme", ACME_KEY) == 401

    run(test)


def test_no_plaintext_key_in_redis_the_audit_log_or_the_logs(run, redis_client, caplog):
    caplog.set_level(logging.DEBUG)

    async def test(a: Replica, b: Replica, _) -> list[str]:
        keys = [ACME_KEY, ADMIN_KEY, await new_tenant(a)]
        kid = (await a.admin("GET", "/tenants/initech/keys")).json()["keys"][0]["id"]
        r = await b.admin("POST", f"/tenants/initech/keys/{kid}/rotate", {"overlap_s": 60})
        keys.append(r.json()["key"])
        keys.append((await b.admin("POST", "/tenants/globex/keys")).json()["key"])
        listed = json.dumps((await a.admin("GET", "/tenants")).json())
        audit = (await a.admin("GET", "/audit?limit=50")).json()["entries"]
        assert [e["action"] for e in audit[:3]] == ["keys.create", "keys.rotate", "keys.create"]
        assert all(e["admin"].startswith("admin-") and e["from"] and e["at"] for e in audit)
        assert not any(k in listed or k in json.dumps(audit) for k in keys)
        return keys

    keys = run(test)
    dump = []
    for k in redis_client.scan_iter(count=1000):
        dump.append(k)
        kind = redis_client.type(k).decode()
        if kind == "string":
            dump.append(redis_client.get(k))
        elif kind == "hash":
            dump.extend(x for kv in redis_client.hgetall(k).items() for x in kv)
        elif kind == "list":
            dump.extend(redis_client.lrange(k, 0, -1))
        elif kind == "set":
            dump.extend(redis_client.smembers(k))
        elif kind == "zset":
            dump.extend(m for m, _ in redis_client.zrange(k, 0, -1, withscores=True))
        elif kind == "stream":
            dump.extend(x for _, f in redis_client.xrange(k) for kv in f.items() for x in kv)
    blob = b"\n".join(x if isinstance(x, bytes) else str(x).encode() for x in dump)
    assert redis_client.xlen(AUDIT_KEY) >= 4 and b"salt" in blob
    logs = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "tenant initech created" in logs
    for key in keys:
        assert key.encode() not in blob and key not in logs


def test_bad_input_is_refused_and_leaves_nothing_behind(run, redis_client):
    async def test(a: Replica, b: Replica, _) -> None:
        before = (redis_client.get(VERSION_KEY), redis_client.hgetall(REGISTRY_KEY))
        cases = [
            ("POST", "/tenants", {"name": "acme"}, 409, "exists already"),
            ("POST", "/tenants", "{not json", 400, "malformed JSON"),
            ("POST", "/tenants", [1], 400, "JSON object"),
            ("POST", "/tenants", {"name": "Bad Name"}, 422, "name:"),
            ("POST", "/tenants", {"name": "x", "limits": {"requests_per_s": 0}}, 422, "limits.requests_per_s:"),
            ("POST", "/tenants", {"name": "x", "cache": {"mode": "sometimes"}}, 422, "cache.mode:"),
            ("POST", "/tenants", {"name": "x", "colour": "red"}, 422, "colour:"),
            ("POST", "/tenants", {"name": "x", "api_keys": ["sk-abcdefgh"]}, 422, "api_keys:"),
            ("POST", "/tenants", {"name": "admin"}, 422, "name:"),
            ("PATCH", "/tenants/nobody", {"limits": {"requests_per_s": 1}}, 404, "no tenant"),
            ("PATCH", "/tenants/acme", {"limits": {"requests_per_s": -1}}, 422, "limits.requests_per_s:"),
            ("PATCH", "/tenants/acme", {"prices": {"input": 0.1234567}}, 422, "prices.input:"),
            ("PATCH", "/tenants/acme", {"name": "other"}, 422, "name:"),
            ("DELETE", "/tenants/nobody", None, 404, "no tenant"),
            ("GET", "/tenants/nobody", None, 404, "no tenant"),
            ("POST", "/tenants/nobody/keys", None, 404, "no tenant"),
            ("DELETE", "/tenants/acme/keys/key-missing", None, 404, "no key"),
            ("POST", "/tenants/acme/keys/key-missing/rotate", {"overlap_s": 5}, 404, "no key"),
            ("POST", "/tenants/acme/keys/key-missing/rotate", {"overlap_s": -5}, 422, "overlap_s:"),
            ("POST", "/tenants/acme/keys/key-missing/rotate", {"overlap": 5}, 422, "overlap:"),
        ]
        for method, path, body, status, words in cases:
            r = await a.admin(method, path, body)
            assert r.status_code == status, (method, path, body, r.text)
            assert words in r.json()["error"]["message"], (method, path, r.text)
        assert (redis_client.get(VERSION_KEY), redis_client.hgetall(REGISTRY_KEY)) == before
        assert redis_client.exists(AUDIT_KEY) == 0  # refused actions change nothing, so log nothing
        r = await a.http.get("/admin/v1/tenants", headers={"Authorization": f"Bearer {ACME_KEY}"})
        assert r.status_code == 401  # a tenant key never opens the admin API

    run(test)


async def _is(status: Awaitable[int], want: int) -> bool:
    return await status == want


async def _now(value: bool) -> bool:
    return value


def test_the_cli_calls_the_admin_api(monkeypatch, capsys):
    """``kvgrid tenants`` and ``kvgrid keys``: each command's call (method, path, body) and what it prints."""
    from router.cli import build_parser, tenants as cli

    calls: list[tuple[str, str, Any]] = []

    def fake(args, method: str, path: str, body: Any = None) -> dict:
        calls.append((method, path, body))
        if path.endswith("/keys") and method == "POST" or path.endswith("/rotate"):
            return {"id": "key-1", "key": "sk-kv-shown-once", "prefix": "sk-...once"}
        if path == "/tenants" and method == "GET":
            return {
                "tenants": [
                    {"name": "acme", "origin": "config", "config": {"cache": {"mode": "implicit"}}, "keys": [{}]}
                ]
            }
        if path.endswith("/keys"):
            return {"keys": [{"id": "key-1", "prefix": "sk-...once", "origin": "api", "created": 1.0, "expires": None}]}
        return {"ok": True}

    monkeypatch.setattr(cli, "_admin_call", fake)
    for argv in (
        ["tenants", "create", "initech", "--set", "limits.requests_per_s=20", "--set", "cache.mode=explicit"],
        ["tenants", "update", "initech", "--body", '{"limits": {"tokens_per_min": 1000}}', "--set", "prices=null"],
        ["tenants", "list"],
        ["tenants", "delete", "initech"],
        ["keys", "create", "--tenant", "initech"],
        ["keys", "list", "--tenant", "initech"],
        ["keys", "revoke", "key-1", "--tenant", "initech"],
        ["keys", "rotate", "key-1", "--tenant", "initech", "--overlap", "60"],
    ):
        args = build_parser().parse_args(argv)
        assert args.func(args) == 0
    assert calls == [
        ("POST", "/tenants", {"name": "initech", "limits": {"requests_per_s": 20}, "cache": {"mode": "explicit"}}),
        ("PATCH", "/tenants/initech", {"limits": {"tokens_per_min": 1000}, "prices": None}),
        ("GET", "/tenants", None),
        ("DELETE", "/tenants/initech", None),
        ("POST", "/tenants/initech/keys", None),
        ("GET", "/tenants/initech/keys", None),
        ("DELETE", "/tenants/initech/keys/key-1", None),
        ("POST", "/tenants/initech/keys/key-1/rotate", {"overlap_s": 60.0}),
    ]
    out = capsys.readouterr().out
    assert "sk-kv-shown-once" in out and "acme" in out and "sk-...once" in out
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        cli._section(["limits.requests_per_s"])


async def _chat(rep: Replica, tenant: str, key: str) -> httpx2.Response:
    return await rep.http.post(
        f"/{tenant}/v1/chat/completions",
        json={"model": rep.gw.model_id, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
    )


def test_a_keys_own_limits_hold_on_every_replica_and_change_at_run_time(run):
    async def test(a: Replica, b: Replica, _) -> None:
        plain = await new_tenant(a)  # the tenant allows 100 requests/s
        r = await a.admin("POST", "/tenants/initech/keys", {"limits": {"requests_per_s": 2}})
        assert r.status_code == 201 and r.json()["limits"] == {"requests_per_s": 2}, r.text
        slow, kid = r.json()["key"], r.json()["id"]
        await until(lambda: _is(b.status("initech", slow), 200))
        await asyncio.sleep(1.05)  # a fresh one-second window for the key
        answers = [await _chat(rep, "initech", slow) for rep in (a, b, a)]
        assert [x.status_code for x in answers] == [200, 200, 429], [x.text for x in answers]
        assert kid in answers[2].json()["error"]["message"] and answers[2].headers["retry-after"]
        assert (await _chat(b, "initech", plain)).status_code == 200  # the tenant's other key is not held
        # Raised at run time: the other replica follows within a second.
        r = await a.admin("PATCH", f"/tenants/initech/keys/{kid}", {"limits": {"requests_per_s": 50}})
        assert r.status_code == 200 and r.json()["limits"] == {"requests_per_s": 50}, r.text

        async def lifted() -> bool:
            return (await _chat(b, "initech", slow)).status_code == 200

        await until(lifted, 2.0)
        # Bad input names the field and changes nothing.
        r = await a.admin("PATCH", f"/tenants/initech/keys/{kid}", {"limits": {"requests_per_s": 0}})
        assert r.status_code == 422 and "limits.requests_per_s" in r.json()["error"]["message"]
        r = await a.admin("POST", "/tenants/initech/keys", {"budget": {"period": "weekly", "hard_usd": 1}})
        assert r.status_code == 422 and "budget.period" in r.json()["error"]["message"]
        assert (await a.admin("PATCH", "/tenants/initech/keys/key-nope", {"limits": None})).status_code == 404
        keys = (await a.admin("GET", "/tenants/initech/keys")).json()["keys"]
        assert {k["id"]: k["limits"] for k in keys}[kid] == {"requests_per_s": 50} and len(keys) == 2

    run(test)


def test_a_keys_own_budget_refuses_it_alone_and_shows_in_its_usage(run):
    async def test(a: Replica, b: Replica, _) -> None:
        plain = await new_tenant(a)
        r = await a.admin("PATCH", "/tenants/initech", {"prices": {"input": 1000, "output": 1000}})
        assert r.status_code == 200, r.text
        r = await a.admin("POST", "/tenants/initech/keys", {"budget": {"period": "daily", "hard_usd": 0.1}})
        assert r.status_code == 201, r.text
        capped, kid = r.json()["key"], r.json()["id"]
        await until(lambda: _is(b.status("initech", capped), 200))
        # One request's worst case (prompt and 4 output tokens at $1000/M) fits; spent, the next ones do not.
        answers = [await _chat(rep, "initech", capped) for rep in (a, b, a, b, a, b, a, b)]
        codes = [x.status_code for x in answers]
        assert codes[0] == 200 and 429 in codes, codes
        refused = next(x for x in answers if x.status_code == 429).json()["error"]["message"]
        assert refused.startswith("this API key's daily budget of 0.10 USD"), refused
        assert (await _chat(b, "initech", plain)).status_code == 200  # the tenant (no budget) and its other key
        await asyncio.gather(a.gw.ledger.flush(), b.gw.ledger.flush())
        usage = (await b.http.get("/initech/v1/usage", headers={"Authorization": f"Bearer {capped}"})).json()
        kb = usage["key_budget"]
        assert kb["key_id"] == kid and kb["hard_usd"] == 0.1 and kb["period"] == "daily"
        assert 0 < kb["spent_usd"] <= 0.1 and kb["left_usd"] == round(max(0.0, 0.1 - kb["spent_usd"]), 6)
        other = (await b.http.get("/initech/v1/usage", headers={"Authorization": f"Bearer {plain}"})).json()
        assert "key_budget" not in other and other["budget"] is None

    run(test)
