"""The fault suite: one real `kvgrid serve` (2 worker groups, 2 router replicas, 2 gateway replicas, an external
Redis) under steady load from two tenants, and one process of each kind killed in turn: a rank, a whole group,
a gateway replica, a router replica, the supervisor, and Redis (paused, then killed and replaced by an empty one).

For every fault: no request is lost (each one completes, or gets 429/503 with ``Retry-After``, or its stream
ends with an error event that says to retry), the killed kind is back and both tenants are served again within
``RECOVERY_LIMIT_S`` without anyone's help, and each tenant's p99 latency while it recovers stays within
``P99_FACTOR`` x its steady p99 (measured in the same run: the steady phase plus the seconds before the fault).
``pytest -s`` prints the figures as a table; recovery is counted from the kill (Redis: from when it went down)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from harness import (
    ACME_KEY,
    ADMIN_KEY,
    GLOBEX_KEY,
    TEST_DEFAULTS,
    TWO_TENANTS,
    RedisServer,
    Server,
    free_port,
    wait_for,
)
from load import KINDS, LOST, OK, Load, percentile

STEADY_S = 12.0  # the steady phase, before any fault
PRE_S = 3.0  # steady seconds just before each fault (part of that fault's baseline)
POST_S = 3.0  # seconds watched after recovery: everything started then must succeed
RECOVERY_LIMIT_S = 30.0
WATCH_LIMIT_S = 40.0  # how long a fault is watched for recovery before giving up
REDIS_DOWN_S = 6.0  # Redis stays killed (or paused) this long
P99_FACTOR = 3.0
TENANTS = {"acme": ("openai", ACME_KEY), "globex": ("anthropic", GLOBEX_KEY)}


@dataclass
class Row:
    kind: str
    requests: int
    lost: int
    recovery_s: float | None
    steady_p50: dict[str, float | None]
    steady_p99: dict[str, float | None]
    fault_p99: dict[str, float | None]


@dataclass(repr=False)  # keeps failure reports short
class Rig:
    server: Server
    redis: RedisServer
    load: Load
    steady: tuple[float, float]
    rows: list[Row] = field(default_factory=list)
    unrecovered: list[str] = field(default_factory=list)  # faults the service did not recover from

    def admin_groups(self) -> dict[str, dict] | None:
        """The groups by name per the admin API, or None when it does not answer 200."""
        try:
            r = httpx.get(
                f"{self.server.base}/admin/v1/groups", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
            )
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        return {g["name"]: g for g in r.json()["groups"]}

    def actors(self, title: str) -> set[int]:
        """Pids of this server's Ray worker processes whose title starts with ``ray::{title}``. Ray's processes
        are descendants of the `kvgrid serve` process (its local raylet forks them), which tells them apart from
        other Ray instances on the machine."""
        pids = set()
        for p in psutil.Process(self.server.proc.pid).children(recursive=True):
            try:
                if " ".join(p.cmdline()).startswith(f"ray::{title}"):
                    pids.add(p.pid)
            except psutil.Error:  # it exited meanwhile
                continue
        return pids

    def logs(self) -> list[Path]:
        """The server's own log and its Ray workers' stdout/stderr files (actors print there, not to the
        server's log); the Ray session is found from this server's raylet, never another Ray's."""
        files = [self.server.log]
        for p in psutil.Process(self.server.proc.pid).children(recursive=True):
            try:
                args = p.cmdline()
            except psutil.Error:
                continue
            if args and args[0].endswith("raylet"):
                logs = next((a.split("=", 1)[1] for a in args if a.startswith("--log_dir=")), None)
                if logs:
                    files += sorted(Path(logs).glob("worker-*.out")) + sorted(Path(logs).glob("worker-*.err"))
                break
        return files

    def log_sizes(self) -> dict[Path, int]:
        return {f: f.stat().st_size for f in self.logs() if f.exists()}

    def log_lines_since(self, sizes: dict[Path, int]) -> list[str]:
        """Distinct lines written since ``sizes`` by kvgrid itself or about an error (not the access log), with
        how often each came."""
        counts: dict[str, int] = {}
        for f in self.logs():
            with f.open("rb") as fh:
                fh.seek(sizes.get(f, 0))
                text = fh.read(1 << 20).decode(errors="replace")
            for line in text.splitlines():
                if (line.startswith("kvgrid") or "Error" in line or "WARN" in line) and not _ACCESS.search(line):
                    counts[line] = counts.get(line, 0) + 1
        return [f"{line} (x{n})" if n > 1 else line for line, n in counts.items()]

    def gateways(self) -> set[int]:
        pids = {p for p in self.actors("ServeReplica:") if "gateway" in _title(p).lower()}
        assert pids, f"no gateway replica among {[_title(p) for p in self.actors('ServeReplica:')]}"
        return pids


_ACCESS = re.compile(r" -- (GET|POST|PATCH|PUT|DELETE) /")  # Serve's access log lines


def _title(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _serving(groups: dict[str, dict] | None) -> bool:
    return bool(groups) and len(groups) == 2 and all(g["state"] == "serving" for g in groups.values())


def _rank_pids(group: dict) -> set[int]:
    return {r["pid"] for r in group.get("ranks", [])}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    redis_proc = RedisServer(folder)
    port = free_port()
    config = folder / "kvgrid.yaml"
    config.write_text(f"""http: {{host: 127.0.0.1, port: {port}, replicas: 2}}
{TEST_DEFAULTS}kv_cache_bytes: 33554432
router_replicas: 2
routing: {{snapshot_dir: {folder / "router-snapshots"}, snapshot_interval_s: 2}}
admin_keys: [{ADMIN_KEY}]
{TWO_TENANTS}""")
    server = Server(config, redis_proc.url, port, [(t, key) for t, (_, key) in TENANTS.items()])
    load = None
    try:
        server.start()
        load = Load(server.base, TENANTS).__enter__()
        warm = time.monotonic()

        def warmed_up() -> bool:  # every kind of request has run once (first calls compile and load things)
            done = {(r.tenant, r.kind) for r in load.window(warm, time.monotonic()) if r.outcome == OK}
            return len(done) == len(TENANTS) * len(KINDS) and all(load.ok_since(warm, t) >= 8 for t in TENANTS)

        wait_for(warmed_up, 120, "the load to warm up")
        t0 = time.monotonic()
        time.sleep(STEADY_S)
        rig = Rig(server, redis_proc, load, (t0, time.monotonic()))
        for t in TENANTS:
            steady = sorted((r for r in load.window(*rig.steady, t) if r.outcome == OK), key=lambda r: r.latency)
            print(
                f"steady {t}: {len(steady)} requests, p50 {percentile([r.latency for r in steady], 50):.2f} s, "
                f"slowest: "
                + ", ".join(f"{r.kind} at +{r.start - t0:.1f} s took {r.latency:.2f} s" for r in steady[:-4:-1])
            )
        yield rig
        _print_table(rig.rows)
    finally:
        if load is not None:
            load.stop()
        server.stop()
        redis_proc.stop()


def _print_table(rows: list[Row]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    print("\nfault suite (latencies in ms, acme / globex)")
    print(
        f"{'kind':<14}{'requests':>9}{'lost':>6}{'recovery s':>12}{'steady p50':>14}{'steady p99':>14}{'fault p99':>14}"
    )
    for r in rows:
        rec = "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        p50, p99, fault = ("/".join(ms(v[t]) for t in TENANTS) for v in (r.steady_p50, r.steady_p99, r.fault_p99))
        print(f"{r.kind:<14}{r.requests:>9}{r.lost:>6}{rec:>12}{p50:>14}{p99:>14}{fault:>14}")


@dataclass
class Fault:
    """Timestamps (time.monotonic()) of one fault, and what was learned while injecting it."""

    at: float = 0.0  # the process was killed (or paused)
    end: float = 0.0  # the test stopped injecting (the kill itself; Redis: restarted or resumed)
    back: float | None = None  # the killed kind was seen back
    recovered: float | None = None  # ... and both tenants were served again since


def _run_fault(rig: Rig, kind: str, inject: Callable[[], None], is_back: Callable[[], bool]) -> tuple[Fault, Row]:
    """Check the service is healthy, watch ``PRE_S`` steady seconds, ``inject()`` the fault, wait for
    ``is_back()`` and both tenants to be served again, watch ``POST_S`` more seconds; record and return the
    figures (the caller asserts)."""
    load = rig.load
    check = time.monotonic()
    wait_for(
        lambda: _serving(rig.admin_groups()) and all(load.ok_since(check, t) >= 2 for t in TENANTS),
        15 if rig.unrecovered else 60,
        f"a healthy service before the fault (unrecovered faults before: {rig.unrecovered or 'none'})",
    )
    pre = time.monotonic()
    time.sleep(PRE_S)
    log_from = rig.log_sizes()
    f = Fault(at=time.monotonic())
    inject()
    f.end = time.monotonic()
    while time.monotonic() < f.at + WATCH_LIMIT_S:
        if f.back is None and is_back():
            f.back = time.monotonic()
        if f.back is not None and all(load.ok_since(max(f.back, f.end), t) >= 2 for t in TENANTS):
            f.recovered = time.monotonic()
            break
        time.sleep(0.25)
    time.sleep(POST_S)
    post_end = time.monotonic()
    load.settle(post_end)

    records = load.window(pre, post_end)
    lost = [r for r in records if r.outcome == LOST]
    if kind == "gateway":
        # Requests on the replica that was SIGKILLed die with it: their connections are cut (nothing of kvgrid's
        # survives to say "retry"; the official SDKs retry that by default, this load does not). At most one per
        # client thread can be in flight; every request sent once the replica was gone (``f.end``) counts.
        in_flight = [r for r in lost if r.start < f.end]
        print(f"  in flight on the killed gateway replica: {len(in_flight)}: {[r.detail for r in in_flight[:3]]}")
        assert len(in_flight) <= rig.load.clients, f"gateway: {len(in_flight)} in-flight requests lost"
        lost = [r for r in lost if r.start >= f.end]
    fault_end = f.recovered or post_end
    steady_p50, steady_p99, fault_p99 = {}, {}, {}
    for t in TENANTS:
        # Baseline: requests over before the fault; fault window: those running at any time during recovery.
        baseline = [r for r in load.window(*rig.steady, t) + load.window(pre, f.at, t) if r.end <= f.at]
        during = [r for r in load.window(pre, fault_end, t) if r.end > f.at]
        steady_p50[t] = percentile((r.latency for r in baseline if r.outcome == OK), 50)
        steady_p99[t] = percentile((r.latency for r in baseline if r.outcome == OK), 99)
        fault_p99[t] = percentile((r.latency for r in during if r.outcome == OK), 99)
    row = Row(
        kind,
        len(records),
        len(lost),
        None if f.recovered is None else f.recovered - f.at,
        steady_p50,
        steady_p99,
        fault_p99,
    )
    rig.rows.append(row)
    if f.recovered is None:
        rig.unrecovered.append(kind)
    _print_table([row])
    for r in lost[:5]:
        print(f"  lost: {r.tenant} {r.kind} at +{r.start - f.at:.1f} s: {r.detail}")
    slowest = sorted(
        (r for r in load.window(pre, fault_end) if r.end > f.at and r.outcome == OK), key=lambda r: -r.latency
    )[:8]
    print(  # before the log lines, which a failure report may cut
        "  slowest while recovering: "
        + ", ".join(f"{r.tenant} {r.kind} at +{r.start - f.at:.1f} s took {r.latency:.2f} s" for r in slowest)
    )
    for line in rig.log_lines_since(log_from)[:30]:  # what the server said meanwhile (shown when the test fails)
        print(f"  log: {line[:240]}")

    # The targets.
    assert len(lost) == 0, f"{kind}: {len(lost)} of {len(records)} requests lost, e.g. {[r.detail for r in lost[:3]]}"
    assert row.recovery_s is not None and row.recovery_s <= RECOVERY_LIMIT_S, (
        f"{kind}: no recovery within {RECOVERY_LIMIT_S:.0f} s (kind back after "
        f"{None if f.back is None else round(f.back - f.at, 1)} s, recovered after {row.recovery_s} s)"
    )
    after = load.window(f.recovered + 1.0, post_end)  # a second for requests racing the recovery
    assert after and all(r.outcome == OK for r in after), (
        f"{kind}: failures after recovery: {[(r.tenant, r.outcome, r.detail) for r in after if r.outcome != OK][:3]}"
    )
    for t in TENANTS:
        assert fault_p99[t] is not None, f"{kind}: tenant {t} completed no request while the service recovered"
        assert fault_p99[t] <= P99_FACTOR * steady_p99[t], (
            f"{kind}: {t} p99 {fault_p99[t]:.2f} s while recovering > {P99_FACTOR:g} x steady {steady_p99[t]:.2f} s"
        )
    return f, row


def _kill(pids: set[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def _kill_and_wait(pids: set[int]) -> None:
    """SIGKILL ``pids`` and return once none of them runs any more (gone, or a zombie whose threads all exited:
    its sockets are closed)."""
    _kill(pids)

    def gone(pid: int) -> bool:
        # A zombie leader can still have threads finishing their exit (tearing down a large address space takes a
        # while): its files, the shared listening socket among them, close only when the last one is done. Until
        # then the kernel still queues new connections on that socket, and resets them when it closes.
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
            return len(os.listdir(f"/proc/{pid}/task")) <= 1
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            return True

    wait_for(lambda: all(gone(p) for p in pids), 10, f"{pids} to exit")


def _group_fault(rig: Rig, kind: str, victim: str, pids: set[int]) -> None:
    """Kill ``pids`` (ranks of ``victim``) and check the other group kept completing requests meanwhile."""
    groups = rig.admin_groups()
    other = next(g for g in groups if g != victim)
    before = groups[other]["stats"]["requests"]

    def back() -> bool:
        g = (rig.admin_groups() or {}).get(victim)
        return bool(g) and g["state"] == "serving" and bool(_rank_pids(g)) and not _rank_pids(g) & pids

    f, _ = _run_fault(rig, kind, lambda: _kill(pids), back)
    served = wait_for(rig.admin_groups, 30, "the admin API")[other]["stats"]["requests"] - before
    while_down = [r for r in rig.load.window(f.at, f.back) if r.outcome == OK and r.end < f.back]
    assert served > 0 and while_down, (
        f"{kind}: group {other} served {served} requests, {len(while_down)} completed while {victim} was down"
    )


def test_a_killed_rank_loses_nothing_and_its_group_restarts(rig):
    groups = wait_for(rig.admin_groups, 30, "the admin API")
    victim = sorted(groups)[0]
    ranks = groups[victim]["ranks"]
    # The last rank: with tensor_parallel > 1 a follower, with 1 the group's only (leader) rank.
    _group_fault(rig, "rank", victim, {ranks[-1]["pid"]})


def test_a_killed_group_loses_nothing_while_the_other_group_serves(rig):
    groups = wait_for(rig.admin_groups, 30, "the admin API")
    victim = sorted(groups)[-1]
    _group_fault(rig, "group", victim, _rank_pids(groups[victim]))


def test_a_killed_gateway_replica_loses_nothing_and_is_replaced(rig):
    before = rig.gateways()
    victim = min(before)

    def back() -> bool:
        now = rig.gateways()
        return victim not in now and len(now) >= len(before)

    _run_fault(rig, "gateway", lambda: _kill_and_wait({victim}), back)


def test_a_killed_router_replica_loses_nothing_and_restarts(rig):
    before = rig.actors("RouterService")
    assert len(before) == 2, f"router replicas: {before}"
    victim = min(before)

    def back() -> bool:
        now = rig.actors("RouterService")
        return victim not in now and len(now) == 2 and _serving(rig.admin_groups())

    _run_fault(rig, "router", lambda: _kill({victim}), back)
    # The restarted replica loaded its index snapshot (routing.snapshot_dir, one every 2 s) and read on from there.
    routers = httpx.get(
        f"{rig.server.base}/admin/v1/groups", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    ).json()["routers"]
    restored = [r["restored"] for r in routers if r and r["restored"]]
    assert len(restored) == 1 and restored[0]["keys"] > 0 and sorted(restored[0]["groups"]) == ["g0", "g1"], routers


def test_a_killed_supervisor_loses_nothing_and_restarts(rig):
    before = rig.actors("Supervisor")
    assert len(before) == 1, f"supervisors: {before}"

    def back() -> bool:
        now = rig.actors("Supervisor")
        return len(now) == 1 and not now & before and _serving(rig.admin_groups())

    _run_fault(rig, "supervisor", lambda: _kill(before), back)


def test_a_paused_redis_loses_nothing_and_the_service_resumes(rig):
    def inject() -> None:
        rig.redis.signal(signal.SIGSTOP)
        try:
            time.sleep(REDIS_DOWN_S)
        finally:
            rig.redis.signal(signal.SIGCONT)

    f, _ = _run_fault(rig, "redis pause", inject, lambda: True)
    _served_while_redis_was_down(rig, f)


def _served_while_redis_was_down(rig: Rig, f: Fault) -> None:
    """Neither tenant's plain requests need Redis (keys come from the config, usage is buffered): both must have
    completed requests that started and ended while Redis was unavailable, not merely 503s with Retry-After."""
    for t in TENANTS:
        served = [r for r in rig.load.window(f.at, f.end, t) if r.outcome == OK and r.end <= f.end]
        assert served, f"tenant {t} completed no request while Redis was down"


def test_a_killed_redis_replaced_by_an_empty_one_loses_nothing(rig):
    def inject() -> None:
        rig.redis.kill()
        time.sleep(REDIS_DOWN_S)
        rig.redis.start()  # empty: keys, ledger and streams are gone; auth must not depend on them

    f, _ = _run_fault(rig, "redis restart", inject, lambda: True)
    _served_while_redis_was_down(rig, f)
