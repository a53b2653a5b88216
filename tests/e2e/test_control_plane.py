"""No single point of failure in the control plane: SIGKILL the supervisor, a router replica, then every router
replica of a real `kvgrid serve` under steady load from two tenants; each comes back by itself, the worker
groups (and their caches) survive, and no request is lost. The server joins a Ray cluster the test owns, so
the test can also check that the server's exit leaves no group actor or placement group behind."""

from __future__ import annotations

import json
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
import ray

from harness import (
    ACME_KEY,
    ADMIN_KEY,
    GLOBEX_KEY,
    SYSTEM,
    TWO_TENANTS,
    RedisServer,
    Server,
    chat,
    free_port,
    oa,
    wait_for,
    write_config,
)

RECOVERY_S = 30.0  # the recovery target for a killed control-plane process

HEAD = """
import json, sys, ray
from ray.util.placement_group import placement_group_table
ray.init(address="local", num_cpus=6, include_dashboard=False, _node_ip_address="127.0.0.1",
         object_store_memory=256 * 2**20, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
for line in sys.stdin:  # "left": what of kvgrid's is still in the cluster; end of input: stop the cluster
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "kvgrid"]
    pgs = [p["name"] for p in placement_group_table().values()
           if p["name"].startswith("kvgrid-") and p["state"] != "REMOVED"]
    print(json.dumps({"actors": actors, "placement_groups": pgs}), flush=True)
ray.shutdown()
"""


class Head:
    """A local Ray cluster (head node on 127.0.0.1) that outlives the server joined to it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ
        )
        self.address = self.proc.stdout.readline().strip()
        assert self.address, "the Ray head did not start"

    def left(self) -> dict:
        self.proc.stdin.write("left\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The Ray head, the server's Redis and the server (two router replicas, two groups, two tenants)."""
    head = Head()
    redis_server = RedisServer(tmp_path_factory.mktemp("redis"))
    port = free_port()
    config = write_config(
        tmp_path_factory.mktemp("serve"),
        port,
        f"""
router_replicas: 2
kv_cache_bytes: 33554432
admin_keys: [{ADMIN_KEY}]
{TWO_TENANTS}""",
    )
    server = Server(
        config, redis_server.url, port, [("acme", ACME_KEY), ("globex", GLOBEX_KEY)], args=["--address", head.address]
    )
    try:
        server.start()
        yield head, redis_server, server
    finally:
        server.stop()
        if ray.is_initialized():
            ray.shutdown()
        redis_server.stop()
        head.stop()


@pytest.fixture(scope="module")
def server(cluster):
    return cluster[2]


def control(server) -> dict:
    r = httpx.get(f"{server.base}/admin/v1/groups", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def scale(server, **body) -> httpx.Response:
    return httpx.post(
        f"{server.base}/admin/v1/scale", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, json=body, timeout=600
    )


def answering(server) -> dict | None:
    try:
        return control(server)
    except (httpx.HTTPError, AssertionError):
        return None


def rank_pids(body: dict) -> dict[str, list[int]]:
    return {g["name"]: [r["pid"] for r in g["ranks"]] for g in body["groups"]}


class Load:
    """Both tenants send chat requests back to back (some streamed); every outcome is recorded."""

    def __init__(self, server) -> None:
        self.clients = {"acme": oa(server), "globex": oa(server, "globex", GLOBEX_KEY)}
        self.ok: dict[str, list[float]] = {"acme": [], "globex": []}  # when each completed request was sent
        self.errors: list[tuple[int, str, str | None]] = []  # status, message, Retry-After
        self.lost: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(t, i)) for t in self.clients for i in range(2)]

    def _run(self, tenant: str, i: int) -> None:
        rng = random.Random(f"{tenant}{i}")
        client = self.clients[tenant]
        while not self.stop.is_set():
            system = SYSTEM if rng.random() < 0.5 else f"Session {rng.randrange(10**9)}. " + SYSTEM[::-1]
            question = f"Question {rng.randrange(10**6)} from {tenant} client {i}?"
            sent = time.monotonic()
            try:
                if rng.random() < 0.3:
                    chunks = list(chat(client, question, system, max_tokens=6, stream=True))
                    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
                else:
                    r = chat(client, question, system, max_tokens=6)
                    assert r.choices[0].finish_reason in ("length", "stop")
                self.ok[tenant].append(sent)
            except openai.APIStatusError as exc:
                self.errors.append((exc.status_code, exc.message, exc.response.headers.get("retry-after")))
            except openai.APIError as exc:  # an error event inside a stream that had started (status 200)
                self.errors.append((0, exc.message, None))
            except Exception as exc:  # a dropped connection, a broken stream, a wrong answer: lost
                self.lost.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        wait_for(lambda: all(len(v) >= 2 for v in self.ok.values()), 120, "both tenants' load to start")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)

    def completed_since(self, t: float) -> dict[str, int]:
        """Completed requests per tenant that were sent after ``t``."""
        return {tenant: sum(1 for x in times if x > t) for tenant, times in self.ok.items()}

    def both_served_since(self, t: float, n: int = 2) -> bool:
        return all(c >= n for c in self.completed_since(t).values())

    def assert_nothing_lost(self) -> None:
        print(
            f"load: { ({t: len(v) for t, v in self.ok.items()}) } completed, {len(self.errors)} retryable "
            f"errors {self.errors[:3]}"
        )
        assert not self.lost, self.lost[:5]
        for status, message, retry_after in self.errors:  # only clear, retryable errors
            if status == 0:
                assert "retry" in message, message
            else:
                assert status in (429, 503) and retry_after is not None and message, (status, message)


def cached_tokens(server, tenant: str = "acme", key: str = ACME_KEY) -> int:
    r = chat(oa(server, tenant, key), "Do you rent tandems?", max_tokens=2)
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_killed_supervisor_restarts_and_adopts_the_running_groups(server):
    before = control(server)
    pids = rank_pids(before)
    assert sorted(pids) == ["g0", "g1"] and all(g["state"] == "serving" for g in before["groups"])
    cached_tokens(server)
    assert cached_tokens(server) > 0  # warm: the prompt's prefix is cached on a group
    with Load(server) as load:
        os.kill(before["supervisor"]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        after = wait_for(
            lambda: (b := answering(server)) and b["supervisor"]["pid"] != before["supervisor"]["pid"] and b,
            RECOVERY_S,
            "the admin API to answer with a new supervisor",
        )
        print(f"supervisor back after {time.monotonic() - killed_at:.1f} s")
        wait_for(lambda: load.both_served_since(killed_at), RECOVERY_S, "both tenants to be served after the kill")
    load.assert_nothing_lost()
    # The same rank processes serve: the groups were adopted, not restarted.
    assert rank_pids(after) == pids
    assert all(g["state"] == "serving" and g["restarts"] == 0 for g in after["groups"])
    assert after["supervisor"]["restarted"] is True
    assert cached_tokens(server) > 0  # their caches survived too
    listed = subprocess.run(
        [sys.executable, "-m", "router.cli", "groups", "--url", server.base],
        text=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, "KVGRID_ADMIN_KEY": ADMIN_KEY},
    )
    assert listed.returncode == 0 and listed.stdout.count("serving") == 2, listed.stderr


def test_a_killed_router_replica_comes_back_with_its_groups_and_index(server):
    before = control(server)
    old = before["routers"][0]["pid"]
    with Load(server) as load:
        os.kill(old, signal.SIGKILL)
        killed_at = time.monotonic()

        def recovered():
            body = answering(server)
            if not body or not body["routers"][0] or body["routers"][0]["pid"] == old:
                return None
            mine, other = body["index_keys"]
            held = [g for g, n in (other or {}).items() if n > 0 and g != "?"]
            return body if held and all((mine or {}).get(g, 0) > 0 for g in held) else None

        after = wait_for(recovered, RECOVERY_S, "the replica to come back with every group's index keys")
        print(f"router replica back after {time.monotonic() - killed_at:.1f} s")
        wait_for(lambda: load.both_served_since(killed_at), RECOVERY_S, "both tenants to be served after the kill")
    load.assert_nothing_lost()
    assert after["routers"][0]["groups"] == ["g0", "g1"] == after["routers"][1]["groups"]
    assert rank_pids(after) == rank_pids(before)  # no group was touched
    for _ in range(4):  # requests alternate between the replicas: both route the cached prompt to its group
        assert cached_tokens(server) > 0


def test_losing_every_router_replica_recovers_within_30_s(server):
    before = control(server)
    with Load(server) as load:
        for r in before["routers"]:
            os.kill(r["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: load.both_served_since(killed_at), RECOVERY_S, "both tenants to be served again")
        print(f"served again after {time.monotonic() - killed_at:.1f} s")
    load.assert_nothing_lost()
    after = wait_for(
        lambda: (b := answering(server)) and all(r and r["groups"] == ["g0", "g1"] for r in b["routers"]) and b,
        RECOVERY_S,
        "both replicas to know both groups",
    )
    assert {r["pid"] for r in after["routers"]}.isdisjoint(r["pid"] for r in before["routers"])
    assert cached_tokens(server) > 0


def test_routing_goes_on_while_redis_is_stopped_and_catches_up_after(cluster):
    head, redis_server, server = cluster
    ray.init(address=head.address, namespace="kvgrid", log_to_driver=False)
    replica = ray.get_actor("kvgrid-router-0")
    cached_tokens(server)  # the prompt is cached and every replica's index knows it
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(3)  # the replica's poll is now stuck on Redis
        t = time.monotonic()
        decision = ray.get(replica.route.remote("acme", list(range(100, 164))), timeout=10)
        assert time.monotonic() - t < 5, "routing waited on the stopped Redis"  # it used to wait for good
        ray.get(replica.on_finish.remote(decision.request_id))
        held_while_stopped = ray.get(replica.index_key_counts.remote(), timeout=10)
        assert sum(held_while_stopped.values()) > 0  # the index it had is kept
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    # New events written after Redis is back reach the replica: a prompt of fresh token ids shows up in its index
    # (from the events alone, whichever replica routed it). Not its key count: by now the groups' caches are
    # full, so each new block evicts a cached one and the count stays where it was.
    prompt = [random.randrange(100, 2000) for _ in range(85)]  # 5 full blocks
    oa(server).completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
    wait_for(
        lambda: 5 in ray.get(replica.held.remote("acme", prompt)).values(),
        RECOVERY_S,
        "the replica to catch up on new events",
    )
    print(
        f"replica 0's index: {held_while_stopped} keys while Redis was stopped, "
        f"{ray.get(replica.index_key_counts.remote())} after"
    )


def test_a_drain_of_a_hung_group_ends_at_its_timeout_and_frees_the_group(cluster):
    head, _, server = cluster
    (pid,) = rank_pids(control(server))["g1"]
    os.kill(pid, signal.SIGSTOP)  # its rank answers nothing from now on, like a step that never returns
    try:
        t = time.monotonic()
        r = scale(server, groups=1, remove=["g1"], drain_timeout_s=5)
        took = time.monotonic() - t
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # killed by the release, as it should be
            pass
    print(f"the drain of the hung group took {took:.1f} s")
    assert r.status_code == 200, r.text
    assert [g["name"] for g in r.json()["groups"]] == ["g0"]
    assert took < 5 + 15, f"the drain took {took:.0f} s"
    left = head.left()
    assert "kvgrid-g1" not in left["placement_groups"] and "kvgrid-g1-rank0" not in left["actors"], left
    cached_tokens(server)
    assert cached_tokens(server) > 0


def test_server_exit_leaves_no_group_actor_or_placement_group(cluster):
    head, _, server = cluster
    assert any(a.startswith("kvgrid-g") for a in head.left()["actors"])  # the probe sees them while serving
    server.stop()
    assert server.proc.returncode == 0, server.log_text()[-3000:]
    deadline = time.monotonic() + 60  # the driver's own actors (supervisor, routers) go with it, a bit later
    while (left := head.left()) != {"actors": [], "placement_groups": []}:
        assert time.monotonic() < deadline, f"left behind in the cluster: {left}"
        time.sleep(1)
