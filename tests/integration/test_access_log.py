"""Request ids, the access log and the probes of one gateway replica, in process (no Ray: the group and the router
are stand-ins), and the log formats and relay records they go through (common/logs.py, common/log_relay.py).
tests/e2e/test_health.py checks the same on a real `kvgrid serve`, where the lines reach its console."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import httpx
import pytest

from common.config import ServeConfig
from common.log_relay import LogRelay, from_dict, to_dict
from common.logs import ACCESS_LOGGER, REQUEST_ID, JsonFormatter, RequestIdFilter, TextFormatter
from common.outputs import FinishReason, RequestOutput
from router.gateway.access import AccessLog
from router.gateway.core import Gateway
from router.gateway.health import Health
from router.gateway.store import KeyRing
from router.routing.router import RouteDecision

KEY = "sk-acme-access-log-1"
SECRET_KEY = "sk-secretmarker-XYZ-in-process"
PROMPT = "PROMPTMARKER-in-process"
HEX_ID = re.compile(r"[0-9a-f]{32}")


class Remote:
    """A stand-in for a Ray actor method: ``.remote(...)`` runs ``fn`` (its coroutine is awaited like a ref)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeRouter:
    def __init__(self) -> None:
        self.report = Remote(lambda *a: None)
        self.report_failure = Remote(lambda *a: None)
        self.cancel_route = Remote(lambda *a: None)


class FakeGroup:
    """A group whose every request answers two tokens, the first after a short wait."""

    group = "g0"

    async def astream(self, req, on_silence=None, silence_s: float = 60.0):
        await asyncio.sleep(0.01)
        yield RequestOutput("r", req.tenant, req.prompt, [5], "a", [5], "a", False, None, 0)
        yield RequestOutput("r", req.tenant, req.prompt, [5, 6], "ab", [6], "b", True, FinishReason.STOP, 0)


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def access_records():
    """The access log's records while the test runs (whatever handlers the process has configured)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    capture, disabled, level = Capture(), logger.disabled, logger.level
    logger.addHandler(capture)
    logger.disabled = False
    logger.setLevel(logging.INFO)
    yield capture.records
    logger.removeHandler(capture)
    logger.disabled, logger.level = disabled, level


def _gateway(demo_path, redis_client) -> Gateway:
    config = ServeConfig.model_validate({"model": str(demo_path), "tenants": [{"name": "acme", "api_keys": [KEY]}]})
    gw = Gateway(
        config, KeyRing.from_config(config), str(demo_path), [FakeRouter()], f"unix://{redis_client.socket_file}"
    )

    async def route(tenant, prompt, attempt, failed, api, cache_key=None, n=1, adapter=None):
        return gw.pool.routers[0], RouteDecision(attempt, "g0", 0)

    gw.pool.route = route  # type: ignore[method-assign]
    gw.generation._client = lambda decision: FakeGroup()  # type: ignore[method-assign]
    return gw


def test_request_ids_and_access_log_lines_in_process(demo_path, redis_client, access_records):
    from router.gateway.app import create_app

    gw = _gateway(demo_path, redis_client)
    app = create_app(gw)
    body = {"model": gw.model_id, "messages": [{"role": "user", "content": f"{PROMPT} hi"}], "max_tokens": 4}
    key = {"Authorization": f"Bearer {KEY}"}

    async def run() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60) as c:
            url = "/acme/v1/chat/completions"
            out = {
                "ok": await c.post(url, headers={**key, "X-Request-Id": "my-id-1"}, json=body),
                "stream": await c.post(url, headers=key, json={**body, "stream": True}),
                "refused": await c.post(url, headers={"Authorization": f"Bearer {SECRET_KEY}"}, json=body),
                "bad": await c.post(url, headers={**key, "Content-Type": "application/json"}, content=b"{"),
                "spaced": await c.post(url, headers={**key, "X-Request-Id": "two words"}, json=body),
                "control": await c.post(url, headers={**key, "X-Request-Id": "a\tb"}, json=body),
                "gemini": await c.post(f"/acme/v1beta/models/x:generateContent?key={SECRET_KEY}", json={}),
                "unknown": await c.get("/no/such/path%0Aforged line"),
                "health": await c.get("/health"),
                "ready": await c.get("/ready"),
            }
        await gw.close()
        return out

    r = asyncio.run(asyncio.wait_for(run(), 120))
    assert r["ok"].status_code == 200 and r["ok"].headers["x-request-id"] == "my-id-1"
    assert r["stream"].status_code == 200 and "[DONE]" in r["stream"].text
    assert (r["refused"].status_code, r["bad"].status_code, r["gemini"].status_code) == (401, 400, 401)
    assert r["unknown"].status_code == 404
    for name in ("stream", "refused", "bad", "spaced", "control", "gemini", "unknown", "health", "ready"):
        assert HEX_ID.fullmatch(r[name].headers["x-request-id"]), name  # none sent, or not a sane one: a new one
    assert r["health"].json() == {"status": "ok"}
    # No router replica here answers: not ready, saying why, and naming no tenant.
    assert r["ready"].status_code == 503 and r["ready"].json()["status"] == "not ready"
    assert r["ready"].json()["reasons"] and "acme" not in r["ready"].text

    by_id = {rec.fields["request_id"]: rec for rec in access_records}
    assert r["health"].headers["x-request-id"] not in by_id  # a probe answered 200: not logged
    assert by_id[r["ready"].headers["x-request-id"]].fields["status"] == 503
    ok = by_id["my-id-1"].fields
    usage = r["ok"].json()["usage"]
    assert ok["tenant"] == "acme" and ok["model"] == gw.model_id and ok["status"] == 200
    assert (ok["prompt_tokens"], ok["cached_tokens"], ok["output_tokens"]) == (usage["prompt_tokens"], 0, 2)
    assert ok["method"] == "POST" and ok["path"] == "/acme/v1/chat/completions"
    assert 0 < ok["ttft_ms"] <= ok["total_ms"]
    stream = by_id[r["stream"].headers["x-request-id"]].fields
    assert stream["status"] == 200 and stream["output_tokens"] == 2 and 0 < stream["ttft_ms"] <= stream["total_ms"]
    refused = by_id[r["refused"].headers["x-request-id"]].fields
    assert refused["status"] == 401 and refused["tenant"] is None and refused["output_tokens"] == 0
    gemini = by_id[r["gemini"].headers["x-request-id"]].fields
    assert gemini["path"] == "/acme/v1beta/models/x:generateContent"  # never the query string (a Gemini key)
    unknown = by_id[r["unknown"].headers["x-request-id"]].fields
    assert unknown["path"] == "/no/such/path%0Aforged%20line"  # one line per request, whatever the path holds

    text, js = TextFormatter(), JsonFormatter()
    for rec in access_records:
        line = text.format(rec)
        assert "\n" not in line and f"request_id={rec.fields['request_id']}" in line
        obj = json.loads(js.format(rec))
        assert obj["logger"] == ACCESS_LOGGER and obj["request_id"] == rec.fields["request_id"]
        for out in (line, js.format(rec)):
            assert "secretmarker" not in out and PROMPT not in out and KEY not in out
    line = text.format(by_id["my-id-1"])
    assert " POST /acme/v1/chat/completions 200 request_id=my-id-1 tenant=acme " in line
    assert "prompt_tokens=" in line and "output_tokens=2 " in line and " method=" not in line


def test_the_access_log_can_be_turned_off(access_records):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run(enabled: bool) -> httpx.Response:
        transport = httpx.ASGITransport(app=AccessLog(app, enabled=enabled))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return await c.get("/x", headers={"X-Request-Id": "abc"})

    assert asyncio.run(run(False)).headers["x-request-id"] == "abc" and access_records == []
    assert asyncio.run(run(True)).headers["x-request-id"] == "abc" and len(access_records) == 1


def test_an_unhandled_error_answers_500_with_the_request_id(access_records):
    async def app(scope, receive, send):
        raise RuntimeError("boom")

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=AccessLog(app), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return await c.get("/x")

    r = asyncio.run(run())
    assert r.status_code == 500 and HEX_ID.fullmatch(r.headers["x-request-id"])
    assert access_records[0].fields["status"] == 500


def test_a_json_record_is_one_line_and_the_relay_keeps_records_as_they_were():
    logger = logging.getLogger("router.test_access_log")
    record = logger.makeRecord(
        logger.name, logging.WARNING, __file__, 1, "a %s\nsecond line", ("message",), None, extra={"fields": {"n": 1}}
    )
    token = REQUEST_ID.set("rid-1")
    try:
        RequestIdFilter().filter(record)
    finally:
        REQUEST_ID.reset(token)
    obj = json.loads(JsonFormatter().format(record))
    assert obj["message"] == "a message\nsecond line" and obj["n"] == 1 and obj["request_id"] == "rid-1"
    assert obj["level"] == "WARNING" and obj["logger"] == logger.name and obj["time"].endswith("Z")
    line = TextFormatter().format(record)  # a text record keeps its line breaks (a traceback's too)
    assert line.endswith(" WARNING router.test_access_log: a message\nsecond line n=1 request_id=rid-1")
    # Through the relay (plain data across Ray), then formatted where the console is: the same line.
    again = from_dict(to_dict(record))
    assert JsonFormatter().format(again) == JsonFormatter().format(record)
    assert TextFormatter().format(again) == TextFormatter().format(record)
    try:
        raise ValueError("x")
    except ValueError:
        failed = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "failed", (), __import__("sys").exc_info())
    assert "ValueError: x" in json.loads(JsonFormatter().format(from_dict(to_dict(failed))))["exception"]


def test_the_relay_hands_over_records_in_order_and_counts_what_it_dropped():
    async def run() -> None:
        relay = LogRelay()
        assert await relay.read(0.01) == ([], 0)  # nothing: the read returns after its wait
        reader = asyncio.ensure_future(relay.read(5.0))
        await asyncio.sleep(0.01)
        await relay.write([{"msg": "1"}, {"msg": "2"}], dropped=3)
        assert await asyncio.wait_for(reader, 1.0) == ([{"msg": "1"}, {"msg": "2"}], 3)  # woken by the write

    asyncio.run(run())


def test_readiness_needs_redis_a_router_and_a_group_that_answered(monkeypatch):
    import router.gateway.health as health_mod

    class Redis:
        up = True

        async def ping(self) -> bool:
            if not self.up:
                raise ConnectionError("down")
            return True

    class Leader:
        def __init__(self) -> None:
            self.healthy = True
            self.health = Remote(self._health)

        async def _health(self) -> str | None:
            if not self.healthy:
                raise TimeoutError
            return None

    leader, groups = Leader(), {"g0": None}
    groups["g0"] = leader

    async def leaders() -> dict:
        return dict(groups)

    router = type("R", (), {"leaders_now": Remote(leaders)})()
    redis = Redis()
    monkeypatch.setattr(health_mod, "CACHE_S", 0.0)

    async def run() -> None:
        h = Health(redis, [router])
        assert await h.reasons() == []
        redis.up = False
        assert await h.reasons() == ["redis does not answer (ConnectionError)"]
        redis.up = True
        leader.healthy = False  # it answered a moment ago: still ready for READY_WINDOW_S
        assert await h.reasons() == []
        monkeypatch.setattr(health_mod, "READY_WINDOW_S", 0.0)
        assert await h.reasons() == ["no worker group answered within the last 0 s"]
        groups.clear()
        assert await h.reasons() == ["no worker group is serving (the router knows none)"]
        h.routers = [None]  # a replica that does not answer
        assert await h.reasons() == ["no router replica answers"]

    asyncio.run(run())


def test_concurrent_probes_share_one_check(monkeypatch):
    calls = 0

    async def check(self) -> list[str]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return []

    monkeypatch.setattr(Health, "_check", check)

    async def run() -> None:
        h = Health(None, [])
        assert await asyncio.gather(*(h.reasons() for _ in range(10))) == [[]] * 10
        assert await h.reasons() == []  # within CACHE_S: the cached answer

    asyncio.run(run())
    assert calls == 1
