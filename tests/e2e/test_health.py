"""Operating a real `kvgrid serve`, on one server with a single worker group and the
console in JSON (``logging: {format: json}``): the one test_tracing shares too (tests/conftest.py's
``one_group_server``, harness.one_group_body):

- ``/health`` and ``/ready`` answer 200 without a key and name no tenant; the older ``/-/healthz`` stays;
- the access log reaches the console of `kvgrid serve` through the log relay, one JSON object per line, with the
  request id the response carried, the tenant, the status and the token counts, and never a key or a prompt (a
  marked key and a marked prompt are sent, then looked for in the whole output); ``X-Request-Id`` is echoed when
  sent and made when not, on successes, streams, 401s and 400s alike;
- the supervisor's control events reach the console too;
- ``/ready`` is 503 (with its reasons) while the only group is down and 200 again once the supervisor has restarted
  it; ``/health`` is 200 throughout; ``/admin/v1/status`` lists the groups, the router replicas and Redis.

The group is killed last (marked ``disturbs_server``: after every other test on the server, those of the other
modules on it too): the other tests see a settled server. Without a server:
the supervisor logs when Redis stops answering and when it answers again."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
import uuid

import httpx
import pytest

from harness import ACME_KEY, ADMIN_KEY, ONE_GROUP_TENANTS, RedisServer, wait_for

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SECRET_KEY = f"sk-secretmarker-XYZ{uuid.uuid4().hex[:12]}"  # a key that must never be logged (it is refused)
PROMPT = f"PROMPTMARKER{uuid.uuid4().hex[:12]}"  # a prompt text that must never be logged
TENANT_NAMES = ONE_GROUP_TENANTS  # every tenant of the server
HEX_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture()
def server(one_group_server):
    # One group, the console in JSON, the groups' stats line every second, not every 10 (harness.ONE_GROUP_ENV).
    return one_group_server


def _records(server) -> list[dict]:
    """The console's log records (every line that is a JSON object)."""
    out = []
    for line in server.log_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))  # logging.format json: each record one parseable line
    return out


def _access(server, request_id: str) -> dict | None:
    return next(
        (r for r in _records(server) if r.get("logger") == "kvgrid.access" and r.get("request_id") == request_id), None
    )


def _no_tenant(text: str) -> None:
    assert not any(name in text for name in TENANT_NAMES), text


def test_health_and_ready_answer_without_a_key_and_name_no_tenant(server):
    h = httpx.get(f"{server.base}/health", timeout=10)
    assert h.status_code == 200 and h.json() == {"status": "ok"}
    r = wait_for(
        lambda: (resp := httpx.get(f"{server.base}/ready", timeout=10)).status_code == 200 and resp, 30, "/ready 200"
    )
    assert r.json() == {"status": "ready"}
    for resp in (h, r):
        assert HEX_ID.fullmatch(resp.headers["x-request-id"])
        _no_tenant(resp.text)
    old = httpx.get(f"{server.base}/-/healthz", timeout=10)
    assert old.status_code == 200 and old.text == "success"


def test_request_ids_and_the_access_log_on_the_console_never_show_a_key_or_a_prompt(server):
    base = f"{server.base}/acme/v1/chat/completions"
    key = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": f"{PROMPT} how much is a cargo bike?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    sent_id = f"client-{uuid.uuid4().hex[:8]}"
    ok = httpx.post(base, headers={**key, "X-Request-Id": sent_id}, json=body, timeout=120)
    assert ok.status_code == 200 and ok.headers["x-request-id"] == sent_id
    with httpx.stream("POST", base, headers=key, json={**body, "stream": True}, timeout=120) as stream:
        assert stream.status_code == 200
        streamed_id = stream.headers["x-request-id"]
        text = "".join(stream.iter_text())
    assert HEX_ID.fullmatch(streamed_id) and "[DONE]" in text
    refused = httpx.post(base, headers={"Authorization": f"Bearer {SECRET_KEY}"}, json=body, timeout=30)
    assert refused.status_code == 401 and HEX_ID.fullmatch(refused.headers["x-request-id"])
    # A Gemini client may send its key in the query string: the log has the path without it.
    gemini = httpx.post(
        f"{server.base}/acme/v1beta/models/demo:generateContent?key={SECRET_KEY}",
        json={"contents": [{"parts": [{"text": PROMPT}]}]},
        timeout=30,
    )
    assert gemini.status_code == 401 and HEX_ID.fullmatch(gemini.headers["x-request-id"])
    bad = httpx.post(base, headers={**key, "Content-Type": "application/json"}, content=b"{not json", timeout=30)
    assert bad.status_code == 400 and HEX_ID.fullmatch(bad.headers["x-request-id"])
    insane = httpx.post(base, headers={**key, "X-Request-Id": "x" * 129}, json=body, timeout=120)
    assert insane.status_code == 200 and HEX_ID.fullmatch(insane.headers["x-request-id"])

    rid_401, rid_gemini, rid_400 = (r.headers["x-request-id"] for r in (refused, gemini, bad))
    wait_for(lambda: all(_access(server, i) for i in (sent_id, streamed_id, rid_401, rid_gemini, rid_400)), 30, "lines")
    line = _access(server, sent_id)
    assert line is not None
    assert line["method"] == "POST" and line["path"] == "/acme/v1/chat/completions"
    assert line["tenant"] == "acme" and line["model"] == "demo" and line["status"] == 200
    usage = ok.json()["usage"]
    assert line["prompt_tokens"] == usage["prompt_tokens"] and line["output_tokens"] == usage["completion_tokens"]
    assert line["cached_tokens"] == (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert 0 < line["ttft_ms"] <= line["total_ms"]
    streamed = _access(server, streamed_id)
    assert streamed is not None and streamed["status"] == 200 and streamed["output_tokens"] > 0
    assert streamed["ttft_ms"] is not None and streamed["ttft_ms"] <= streamed["total_ms"]
    for rid, status in ((rid_401, 401), (rid_gemini, 401), (rid_400, 400)):
        rec = _access(server, rid)
        assert rec is not None and rec["status"] == status and rec["output_tokens"] == 0
    assert _access(server, rid_401)["tenant"] is None  # refused: no tenant was admitted
    assert _access(server, rid_gemini)["path"] == "/acme/v1beta/models/demo:generateContent"
    assert _access(server, rid_400)["tenant"] == "acme"
    # The console, every line of it: neither marker, nor the tenant's real key.
    output = server.log_text()
    assert "secretmarker" not in output and "PROMPTMARKER" not in output and ACME_KEY not in output
    # The supervisor's control events came through the relay too, in the same format.
    assert any(
        r["logger"] == "router.control.supervisor" and r["message"] == "group g0 is serving" for r in _records(server)
    )


def test_each_group_logs_a_stats_line_after_traffic_and_ray_starts_quietly(server):
    def stats() -> list[dict]:
        return [r for r in _records(server) if r.get("logger") == "worker.stats"]

    before = len(stats())
    r = httpx.post(
        f"{server.base}/acme/v1/completions",
        headers={"Authorization": f"Bearer {ACME_KEY}"},
        json={"model": "demo", "prompt": "stats line " * 20, "max_tokens": 16},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    busy = wait_for(
        lambda: [s["message"] for s in stats()[before:] if "generation 0.0 tokens/s" not in s["message"]],
        30,
        "a stats line with output tokens",
    )
    line = busy[0]
    assert re.fullmatch(
        r"group g0: running \d+ reqs, waiting \d+ reqs, prompt [\d.]+ tokens/s, generation [\d.]+ tokens/s, "
        r"KV cache use GPU [\d.]+%(, \w+ [\d.]+%)*, prefix cache hit rate [\d.]+%",
        line,
    ), line
    # Idle: a line at most once more (the interval after the traffic), then none.
    time.sleep(3)
    idle = len(stats())
    time.sleep(3)
    assert len(stats()) == idle
    # Ray's start noise (the supervisor's actor-handle arguments "in the object store") is gone.
    assert "constructor arguments" not in server.log_text()


def _ranks(server) -> set[int]:
    r = httpx.get(f"{server.base}/admin/v1/groups", headers=ADMIN, timeout=60)
    r.raise_for_status()
    return {rank["pid"] for g in r.json()["groups"] for rank in g.get("ranks", [])}


@pytest.mark.disturbs_server
def test_ready_is_503_while_the_only_group_is_down_and_200_after_its_restart(server):
    status = httpx.get(f"{server.base}/admin/v1/status", headers=ADMIN, timeout=60).json()
    assert status["groups"] == [{"name": "g0", "state": "serving", "restarts": 0}]
    assert status["ready"] is True and status["reasons"] == []
    assert status["redis"]["reachable"] is True and status["redis"]["latency_ms"] >= 0
    assert [r["groups"] for r in status["routers"]] == [["g0"]]
    assert status["supervisor"]["answered"] is True and status["gateway"]["pid"] > 0
    pids = _ranks(server)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    down: list[dict] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
        ready = httpx.get(f"{server.base}/ready", timeout=10)
        if ready.status_code == 503:
            body = ready.json()
            assert body["status"] == "not ready" and body["reasons"]
            _no_tenant(ready.text)
            down.append(body)
        elif down:
            assert ready.status_code == 200 and ready.json() == {"status": "ready"}
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"/ready did not go 503 and back to 200 (503 answers: {down[:3]})")
    status = httpx.get(f"{server.base}/admin/v1/status", headers=ADMIN, timeout=60).json()
    assert status["groups"] == [{"name": "g0", "state": "serving", "restarts": 1}]
    assert not _ranks(server) & pids

    def logged() -> bool:
        events = [(r["level"], r["message"]) for r in _records(server) if r["logger"] == "router.control.supervisor"]
        failed = any(lv == "WARNING" and m.startswith("group g0 failed") for lv, m in events)
        return failed and ("INFO", "group g0 restarted and serving") in events

    wait_for(logged, 20, "the restart's control events on the console")


def test_the_supervisor_logs_when_redis_is_lost_and_when_it_is_back(tmp_path, caplog):
    from router.control.supervisor import Supervisor

    redis_server = RedisServer(tmp_path)
    sup = object.__new__(Supervisor)  # only its Redis watch, on its own thread as in a running supervisor
    sup.redis_url, sup.health_interval_s, sup._stop = redis_server.url, 0.1, threading.Event()
    sup.redis_state = {"reachable": None}
    caplog.set_level(logging.INFO, logger="router.control.supervisor")
    watch = threading.Thread(target=sup._watch_redis, daemon=True)
    watch.start()

    def logged(level: int, start: str) -> bool:
        return any(r.levelno == level and r.getMessage().startswith(start) for r in caplog.records)

    try:
        wait_for(lambda: sup.redis_state["reachable"] is True, 10, "the first ping")
        assert sup.redis_state["latency_ms"] >= 0
        redis_server.kill()
        wait_for(lambda: logged(logging.WARNING, "redis does not answer"), 10, "the warning")
        assert sup.redis_state["reachable"] is False
        redis_server.start()  # on the same port
        wait_for(lambda: logged(logging.INFO, "redis answers again"), 10, "the all-clear")
        assert sup.redis_state["reachable"] is True
        assert len([r for r in caplog.records if r.getMessage().startswith("redis")]) == 2  # once each, not per ping
    finally:
        sup._stop.set()
        watch.join(10)
        redis_server.stop()
