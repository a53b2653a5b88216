"""Scaling a running `kvgrid serve` (admin API, `kvgrid scale`) and losing a group, both under steady load."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from harness import ACME_KEY, ADMIN_KEY, SYSTEM, chat, oa, serving, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(
        tmp_path_factory,
        f"""
max_groups: 3
router_replicas: 2
kv_cache_bytes: 33554432
admin_keys: [{ADMIN_KEY}]
tenants:
  - name: acme
    api_keys: [{ACME_KEY}]
    cache: {{mode: implicit, min_prefix_tokens: 32}}
""",
        [("acme", ACME_KEY)],
    ) as srv:
        yield srv


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(
        method, f"{server.base}/admin/v1{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=300, **kw
    )


def groups(server) -> tuple[dict[str, dict], list[dict[str, int]]]:
    """The groups by name, and the index keys per group of each router replica."""
    body = admin(server, "GET", "/groups").json()
    return {g["name"]: g for g in body["groups"]}, body["index_keys"]


def kvgrid(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args, "--url", server.base],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KVGRID_ADMIN_KEY": ADMIN_KEY},
    )


class Load:
    """Clients sending chat requests back to back; every outcome is recorded."""

    def __init__(self, server, clients: int = 3) -> None:
        self.client = oa(server)
        self.ok: list[float] = []  # completion times
        self.errors: list[tuple[int, str, str | None]] = []  # status, message, Retry-After
        self.other: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            stream = rng.random() < 0.3
            # Half the requests share the system prompt, half are cold (a system prompt of their own).
            system = SYSTEM if rng.random() < 0.5 else f"Session {rng.randrange(10**9)}. " + SYSTEM[::-1]
            question = f"Question {rng.randrange(10**6)} from client {i}?"
            try:
                if stream:
                    chunks = list(chat(self.client, question, system, stream=True))
                    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
                else:
                    r = chat(self.client, question, system, max_tokens=6)
                    assert r.choices[0].finish_reason in ("length", "stop")
                self.ok.append(time.monotonic())
            except openai.APIStatusError as exc:
                self.errors.append((exc.status_code, exc.message, exc.response.headers.get("retry-after")))
            except openai.APIError as exc:  # an error event inside a stream that had started (status 200)
                self.errors.append((0, exc.message, None))
            except Exception as exc:  # anything else (a dropped connection, a broken stream) is a lost request
                self.other.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)

    def completed_since(self, t: float) -> int:
        return sum(1 for x in self.ok if x > t)

    def assert_nothing_lost(self) -> None:
        print(f"load: {len(self.ok)} completed, {len(self.errors)} retryable errors {self.errors[:3]}")
        assert not self.other, self.other[:5]
        for status, message, retry_after in self.errors:  # only clear, retryable errors
            if status == 0:  # a stream cut by its group's death: the event says so
                assert "failed during the request; retry" in message, message
            else:
                assert status in (429, 503) and retry_after is not None and message, (status, message)


def test_scale_two_to_three_and_back_under_load_loses_nothing(server):
    headers = {"Authorization": f"Bearer {ACME_KEY}"}
    assert admin(server, "GET", "/groups").status_code == 200
    assert httpx.get(f"{server.base}/admin/v1/groups", headers=headers).status_code == 401  # a tenant key
    with Load(server) as load:
        wait_for(lambda: len(load.ok) >= 3, 120, "the load to start")
        up = kvgrid(server, "scale", "--groups", "3")
        assert up.returncode == 0, up.stderr
        assert "g2" in up.stdout and "serving" in up.stdout
        wait_for(lambda: groups(server)[0]["g2"]["stats"]["requests"] > 0, 120, "g2 to receive requests")
        s = wait_for(lambda: (st := groups(server)[0]["g2"]["stats"])["steps"] > 0 and st, 30, "g2 to step")
        assert 0 < s["step_cpu_seconds"] and 0 < s["step_seconds"], s  # the engine's own step times, per group

        # A cached content object is pinned on one group; drain exactly that group.
        doc = "The lighthouse tour starts at the north quay at ten and at two. " * 8
        r = httpx.post(
            f"{server.base}/acme/v1/cachedContents",
            headers=headers,
            timeout=120,
            json={"contents": [{"parts": [{"text": doc}]}], "ttl": "600s"},
        )
        assert r.status_code == 200, r.text
        cc = r.json()
        before, index = groups(server)
        holders = [g for g, info in before.items() if info["stats"]["blocks_pinned"] > 0]
        assert len(holders) == 1
        holder = holders[0]
        pinned = before[holder]["stats"]["blocks_pinned"]
        wait_for(
            lambda: all(ix.get(holder, 0) > 0 for ix in groups(server)[1]),
            30,
            "the holder's events to reach both router replicas",
        )

        down = kvgrid(server, "scale", "--groups", "2", "--remove", holder)
        assert down.returncode == 0, down.stderr
        after, index = groups(server)
        assert sorted(after) == sorted(g for g in before if g != holder)
        assert len(index) == 2
        for ix in index:  # no key of the drained group is left in either replica's index
            assert holder not in ix and "?" not in ix
        assert sum(info["stats"]["blocks_pinned"] for info in after.values()) >= pinned  # the pins moved
        t = time.monotonic()
        wait_for(lambda: load.completed_since(t) >= 3, 120, "requests to complete after the drain")
    load.assert_nothing_lost()
    assert len(load.ok) >= 10
    used = oa(server).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "When does the tour start?"}],
        max_tokens=2,
        temperature=0,
        extra_body={"cached_content": cc["name"]},
    )
    assert used.usage.prompt_tokens_details.cached_tokens >= cc["usageMetadata"]["totalTokenCount"] // 16 * 16


def test_scale_refuses_bad_requests_and_bad_keys(server):
    assert admin(server, "POST", "/scale", json={"groups": 9}).status_code == 400  # over max_groups
    assert admin(server, "POST", "/scale", json={"groups": 2, "remove": ["nope"]}).status_code == 400
    assert admin(server, "POST", "/scale", json={"groups": 0}).status_code == 400
    metrics = admin(server, "GET", "/metrics").text
    assert 'kvgrid_group_free_blocks{group="g0"}' in metrics and "kvgrid_group_pinned_blocks" in metrics
    bad = kvgrid(server, "scale", "--groups", "2", "--admin-key", "not-the-admin-key-at-all")
    assert bad.returncode == 2 and "401" in bad.stderr
    listed = kvgrid(server, "groups")
    assert listed.returncode == 0 and listed.stdout.count("serving") == 2


def test_a_killed_group_is_avoided_and_restarted_while_the_cluster_keeps_serving(server):
    before, _ = groups(server)
    victim = sorted(before)[0]
    pid = before[victim]["ranks"][0]["pid"]
    with Load(server) as load:
        wait_for(lambda: len(load.ok) >= 3, 120, "the load to start")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(
            lambda: groups(server)[0][victim]["restarts"] == 1 and groups(server)[0][victim]["state"] == "serving",
            180,
            "the group to restart",
        )
        t = time.monotonic()
        wait_for(lambda: load.completed_since(t) >= 3, 120, "requests to complete after the restart")
    load.assert_nothing_lost()
    assert load.completed_since(killed_at) >= 3
    after, _ = groups(server)
    assert after[victim]["ranks"][0]["pid"] != pid and all(g["state"] == "serving" for g in after.values())
    assert chat(oa(server), "Are you back?").choices[0].finish_reason in ("length", "stop")
