"""The supervisor: owns a deployment's worker groups. It starts them, adds and drains groups when asked to scale,
and restarts a group that fails. It runs as a threaded Ray actor beside the router and tells the router which
groups exist; the router never starts or stops a group itself.

Draining a group: the router stops sending it new requests, its explicit cache entries (pins) are recomputed and
pinned on the groups that will hold them from now on, its in-flight requests run to the end, then the router
drops the group and every index entry it had, and the group's actors and placement group go away.

Crashes: the groups' actors and placement groups are detached and named, so they outlive the supervisor. Ray
restarts a dead supervisor (``max_restarts``), and the new one adopts the groups it finds instead of starting
any. Every health check also hands each router replica the serving groups it is missing (a restarted replica
starts empty) and drops those that no longer exist.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import ray
from ray import ObjectRef
from ray.util.placement_group import placement_group_table

from common.errors import GroupUnhealthyError
from common.event_stream import stream_client
from common.log_relay import relay_logging
from common.protocol import RankHandle, RouterHandle, Submit
from common.sampling import SamplingParams
from router.clients import RouterClient
from router.routing.service import restarted
from worker.group import GroupConfig, WorkerGroup, pg_name
from worker.group_client import GroupClient


class GroupState(enum.StrEnum):
    """A group's state in the supervisor (the same strings in `kvgrid groups` and the admin API)."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    RESTARTING = "restarting"
    FAILED = "failed"


STARTING, SERVING, DRAINING, RESTARTING, FAILED = GroupState
ROUTER_TIMEOUT_S = 30.0
ROUTER_POLL_TIMEOUT_S = 5.0  # the health check's questions to the router replicas: a restarting one is skipped
RECOMPUTE_TIMEOUT_S = 300.0  # one output of a pinned entry's recompute on another group
REDIS_TIMEOUT_S = 2.0
_GROUP_PG = re.compile(r"kvgrid-g([0-9]+)")  # a group's placement group (group names are g0, g1, ...)

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(
        self,
        template: GroupConfig,
        routers: Sequence[RouterHandle | str],
        redis_url: str | None = None,
        health_interval_s: float = 1.0,
        drain_timeout_s: float = 120.0,
        max_groups: int | None = None,
    ) -> None:
        relay_logging()  # its messages are the operator's account of the groups: on `kvgrid serve`'s console
        self.template = template
        # The RouterService replicas (handles, or the names `kvgrid serve` passes: an actor handle among the
        # arguments of an actor Ray may restart makes Ray warn that a restart could lose them): each learns of
        # every group change.
        self.routers = [RouterClient(ray.get_actor(r) if isinstance(r, str) else r) for r in routers]
        self.router = self.routers[0]  # the one that places moved pins
        self.redis_url = redis_url
        self.health_interval_s = health_interval_s
        self.drain_timeout_s = drain_timeout_s
        self.max_groups = max_groups
        self.groups: dict[str, WorkerGroup] = {}
        self.state: dict[str, GroupState] = {}
        self.restarts: dict[str, int] = {}
        self._next = 0
        self._mu = threading.Lock()  # guards the two dicts above; never held across a remote call
        self._scaling = threading.Lock()  # one scale operation at a time
        # Telling the routers that a group joins or leaves, and the health check's reconciliation of the
        # routers' group sets, one at a time: the reconciliation never re-adds a group being released.
        self._members = threading.Lock()
        self._stop = threading.Event()
        if restarted():
            self._adopt()
        else:  # a fresh deployment: anything left by an earlier run that crashed is not ours to serve with
            stale = WorkerGroup.remove_all()
            if stale:
                _log(f"removed what an earlier run left behind: {', '.join(stale)}")
        self._watcher = threading.Thread(target=self._watch, name="kvgrid-supervisor-health", daemon=True)
        self._watcher.start()
        # Redis's state as the last check found it (its own thread: a paused Redis must not delay group checks).
        self.redis_state: dict = {"reachable": None}
        if self.redis_url:
            threading.Thread(target=self._watch_redis, name="kvgrid-supervisor-redis", daemon=True).start()

    # -- scaling ----------------------------------------------------------------------------------------------

    def scale(self, groups: int, remove: Sequence[str] = (), drain_timeout_s: float | None = None) -> list[dict]:
        """Run ``groups`` groups: start new ones (each receives traffic once healthy) or drain the surplus
        (the ones named in ``remove`` first, then the newest). A group that failed and could not restart is
        dropped first. Returns ``describe()``."""
        if groups < 1:
            raise ValueError("groups must be >= 1 (drain a deployment by stopping kvgrid serve)")
        if self.max_groups is not None and groups > self.max_groups:
            raise ValueError(f"groups must be <= {self.max_groups} (max_groups in the config)")
        with self._scaling:
            with self._mu:
                failed = [g for g, s in self.state.items() if s == FAILED]
                for g in failed:
                    self.state[g] = DRAINING  # the health check leaves it alone from now on
            for g in failed:
                self._release(g)
            with self._mu:
                active = [g for g, s in self.state.items() if s in (SERVING, RESTARTING)]
                serving = [g for g in active if self.state[g] == SERVING]
            unknown = [g for g in remove if g not in serving]
            if unknown:
                raise ValueError(f"no serving worker group {', '.join(unknown)} (serving: {', '.join(serving)})")
            surplus = len(active) - groups
            if len(set(remove)) > max(0, surplus):
                raise ValueError(
                    f"remove names {len(set(remove))} group(s) but scaling to {groups} removes {max(0, surplus)}"
                )
            if surplus:
                _log(f"scaling {'down' if surplus > 0 else 'up'} from {len(active)} to {groups} worker group(s)")
            self._add_many(-surplus)
            victims = list(dict.fromkeys(remove)) + [g for g in reversed(serving) if g not in remove]
            for name in victims[: max(0, surplus)]:
                self._drain(name, self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s)
        return self.describe()

    def _add_many(self, n: int) -> None:
        """Start ``n`` groups at once (a group's start is mostly its ranks' processes starting and loading the
        model: on 2 cores two groups took 9.4 + 5.2 s one after the other). Each serves as soon as it is healthy;
        when any fails to start, the others still start, and the first failure is raised."""
        if n < 1:
            return
        with ThreadPoolExecutor(n, thread_name_prefix="kvgrid-group-start") as pool:
            futures = [pool.submit(self._add) for _ in range(n)]
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            raise errors[0]

    def _add(self) -> str:
        with self._mu:
            name = f"g{self._next}"
            self._next += 1
            self.state[name] = STARTING
        try:
            group = WorkerGroup(dataclasses.replace(self.template, name=name))  # cleans up after itself on failure
            reason = group.health()
            if reason is not None:
                group.shutdown()
                raise RuntimeError(f"worker group {name} started unhealthy: {reason}")
        except BaseException:
            with self._mu:
                self.state.pop(name, None)
            raise
        with self._mu:
            self.groups[name] = group
        with self._members:
            # From now on it receives requests.
            self._tell_routers(lambda r: r.add_group(name, group.leader), f"add_group({name})")
            with self._mu:
                self.state[name] = SERVING
        _log(f"group {name} is serving")
        return name

    def _adopt(self) -> None:
        """After a restart: take over the groups the previous incarnation left running (found by name), start
        nothing, and number new groups after every name used so far in this Ray cluster."""
        numbers = {
            int(m.group(1))
            for info in placement_group_table().values()  # removed ones too: never reused
            if (m := _GROUP_PG.fullmatch(info.get("name", "")))
        }
        routed = self._router_groups()
        numbers |= {int(g[1:]) for groups in routed if groups for g in groups if re.fullmatch(r"g[0-9]+", g)}
        self._next = max(numbers, default=-1) + 1
        known = set().union(*(groups or {} for groups in routed))
        for n in sorted(numbers):
            name = f"g{n}"
            group = WorkerGroup.adopt(dataclasses.replace(self.template, name=name))
            if group is None:
                continue
            if len(group.ranks) < self.template.tp and name not in known:
                group.shutdown()  # caught mid-start or mid-release: no router ever served it
                _log(f"removed the incomplete group {name}")
                continue
            state = SERVING
            try:
                group.stats(timeout_s=10)
            except GroupUnhealthyError as exc:  # e.g. not set up: the health check restarts it
                _log(f"adopted group {name} is broken ({exc}); restarting it", logging.WARNING)
                state = FAILED
            except Exception:  # busy or slow: the health check decides
                pass
            self.groups[name], self.state[name] = group, state
            _log(f"adopted group {name} ({state})")
        self._reconcile_routers(routed)

    def _drain(self, name: str, timeout_s: float) -> None:
        with self._mu:
            group = self.groups[name]
            self.state[name] = DRAINING  # from now on the health check leaves it alone
        deadline = time.monotonic() + timeout_s
        self._tell_routers(lambda r: r.pause_group(name), f"pause_group({name})")
        _log(f"draining group {name}")
        moved: set[tuple[str, tuple[int, ...]]] = set()
        responsive = self._move_pins(name, group, moved, deadline)
        while responsive and time.monotonic() < deadline:
            try:
                s = group.stats(timeout_s=max(0.1, min(WorkerGroup.CALL_TIMEOUT_S, deadline - time.monotonic())))
            except Exception as exc:  # dead, or hung in a step: nothing more will finish there
                _log(f"group {name} does not answer while draining ({type(exc).__name__})", logging.WARNING)
                responsive = False
                break
            if s.running == 0 and s.waiting == 0:
                break
            time.sleep(0.05)
        else:
            if responsive:
                _log(f"group {name}: requests still running after {timeout_s:.0f} s; they fail now", logging.WARNING)
        if responsive:  # pins made by the requests that were still running
            self._move_pins(name, group, moved, time.monotonic() + 10)
        self._release(name, graceful=responsive)
        _log(f"group {name} drained and removed ({len(moved)} pinned entries moved)")

    def _release(self, name: str, graceful: bool = True) -> None:
        """Drop a group from the routers (with its index entries) and free its actors and placement group."""
        with self._members:
            self._tell_routers(lambda r: r.remove_group(name), f"remove_group({name})")
            with self._mu:
                group = self.groups.pop(name, None)
                self.state.pop(name, None)
        if group is not None:
            group.shutdown(graceful)
        self._drop_stream(name)

    def _move_pins(self, name: str, group: WorkerGroup, moved: set, deadline: float) -> bool:
        """Recompute and pin the draining group's explicit cache entries on the groups the router picks now
        (each entry once: ``moved`` remembers them). False when the group did not answer by ``deadline``."""
        try:
            entries = group.pinned_entries(timeout_s=max(0.1, min(60.0, deadline - time.monotonic())))
        except Exception:
            return False
        for tenant, tokens, ttl_s in sorted(entries, key=lambda e: -len(e[1])):  # longest first: covers the rest
            if (tenant, tuple(tokens)) in moved:
                continue
            try:
                decision = ray.get(self.router.route(tenant, tokens, None, [name]), timeout=30)
                try:
                    params = SamplingParams(max_tokens=1, temperature=0.0)
                    req = Submit(tokens, params, tenant, decision.request_id, len(tokens), ttl_s)
                    GroupClient(decision.group, decision.leader).run(req, RECOMPUTE_TIMEOUT_S)
                finally:
                    self.router.on_finish(decision.request_id)
                moved.add((tenant, tuple(tokens)))
            except Exception as exc:  # the entry is lost on this group only: it is recomputed on next use
                _log(f"group {name}: could not move a pinned entry ({type(exc).__name__})", logging.WARNING)
        return True

    def _drop_stream(self, name: str) -> None:
        """Delete a released group's event stream; Redis being down or slow costs at most a few seconds."""
        if not self.redis_url:
            return
        import redis

        from common.event_stream import stream_name

        client = stream_client(self.redis_url, REDIS_TIMEOUT_S)
        try:
            client.delete(stream_name(name))
        except redis.RedisError as exc:  # the stream stays; a reader of a removed group ignores it
            _log(f"could not delete the event stream of {name} ({type(exc).__name__})")
        finally:
            client.close()

    def _tell_routers(
        self,
        call: Callable[[RouterClient], ObjectRef[None]],
        what: str,
        routers: Sequence[RouterClient] | None = None,
        timeout_s: float = ROUTER_TIMEOUT_S,
    ) -> None:
        """``call(replica)`` on every router replica (or those in ``routers``), named ``what`` in the log; a replica
        that fails or does not answer is logged, not fatal (the health check catches it up once it answers)."""
        refs = [call(r) for r in (self.routers if routers is None else routers)]
        deadline = time.monotonic() + timeout_s
        for ref in refs:
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                _log(f"router replica: {what} failed ({type(exc).__name__})", logging.WARNING)

    def _router_groups(self) -> list[dict | None]:
        """Each router replica's groups (``RouterService.groups``), None for a replica that did not answer
        within ``ROUTER_POLL_TIMEOUT_S`` (dead or restarting)."""
        refs = [r.groups() for r in self.routers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ROUTER_POLL_TIMEOUT_S)
        out: list[dict | None] = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=0) if ref in ready else None)
            except Exception:
                out.append(None)
        return out

    def _reconcile_routers(self, routed: list[dict | None]) -> None:
        """Give every replica that answered the serving groups it lacks (a restarted replica starts empty and
        rebuilds each group's index from its event stream) and drop the groups that no longer exist."""
        with self._members:
            serving = self.serving_groups()
            with self._mu:
                known = set(self.state)
            for router, groups in zip(self.routers, routed):
                if groups is None:
                    continue
                for g in sorted(serving.keys() - groups.keys()):
                    _log(f"a router replica lacks group {g}; adding it")
                    add = partial(RouterClient.add_group, group=g, leader=serving[g])
                    self._tell_routers(add, f"add_group({g})", [router], ROUTER_POLL_TIMEOUT_S)
                for g in sorted(groups.keys() - known):
                    _log(f"a router replica still has the removed group {g}; dropping it")
                    remove = partial(RouterClient.remove_group, group=g)
                    self._tell_routers(remove, f"remove_group({g})", [router], ROUTER_POLL_TIMEOUT_S)

    # -- failures ---------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check()
            except Exception as exc:  # never let the watcher die
                _log(f"health check failed: {type(exc).__name__}: {exc}", logging.WARNING)

    def check(self) -> None:
        """Restart every serving group that has failed (and retry failed restarts); resume routing to a group
        that was reported failed but is healthy."""
        routed = self._router_groups()  # a replica that does not answer must not stop the health checks
        self._reconcile_routers(routed)
        with self._mu:
            watched = [(g, self.groups[g]) for g, s in self.state.items() if s in (SERVING, FAILED)]
        paused = {g for groups in routed if groups for g, info in groups.items() if info["paused"]}
        for name, group in watched:
            try:
                reason = group.health()
            except Exception as exc:
                reason = f"health check failed: {type(exc).__name__}"
            with self._mu:
                state = self.state.get(name)
                if state not in (SERVING, FAILED):
                    continue  # a drain or a scale took it meanwhile
                healthy = reason is None and state == SERVING
                if not healthy:
                    self.state[name] = RESTARTING
            if not healthy:
                self._restart(name, group, reason or "it was not running")
            elif name in paused:
                self._tell_routers(partial(RouterClient.pause_group, group=name, paused=False), f"resume_group({name})")
                with self._mu:
                    drained = self.state.get(name) != SERVING
                if drained:  # a drain paused it meanwhile: it must stay paused
                    self._tell_routers(partial(RouterClient.pause_group, group=name), f"pause_group({name})")

    def _watch_redis(self) -> None:
        """Ping Redis every health interval; log when it stops answering and when it answers again."""
        import redis

        assert self.redis_url is not None  # started only with one
        client = stream_client(self.redis_url, REDIS_TIMEOUT_S)
        lost_at: float | None = None
        while not self._stop.wait(self.health_interval_s):
            start = time.monotonic()
            try:
                client.ping()
            except redis.RedisError as exc:
                self.redis_state = {"reachable": False, "error": type(exc).__name__}
                if lost_at is None:
                    lost_at = start
                    _log(f"redis does not answer ({type(exc).__name__}); what needs it gets 503", logging.WARNING)
                continue
            except Exception as exc:  # never let the watcher die
                self.redis_state = {"reachable": False, "error": type(exc).__name__}
                continue
            self.redis_state = {"reachable": True, "latency_ms": round((time.monotonic() - start) * 1000, 2)}
            if lost_at is not None:
                _log(f"redis answers again (it was unreachable for {time.monotonic() - lost_at:.0f} s)")
                lost_at = None
        client.close()

    def _restart(self, name: str, group: WorkerGroup, reason: str) -> None:
        _log(f"group {name} failed ({reason}); restarting it", logging.WARNING)
        # Its cache is gone: drop the group and its index entries now, re-add it once it serves again.
        self._tell_routers(lambda r: r.remove_group(name), f"remove_group({name})")
        try:
            group.restart()
        except Exception as exc:
            with self._mu:
                if self.state.get(name) == RESTARTING:
                    self.state[name] = FAILED  # retried at the next check
            _log(f"group {name} could not restart: {type(exc).__name__}: {exc}", logging.ERROR)
            return
        with self._mu:
            if self.state.get(name) != RESTARTING:
                return
        self._tell_routers(lambda r: r.add_group(name, group.leader), f"add_group({name})")
        with self._mu:
            self.state[name] = SERVING
            self.restarts[name] = self.restarts.get(name, 0) + 1
        _log(f"group {name} restarted and serving")

    # -- inspection -------------------------------------------------------------------------------------------

    def describe(self) -> list[dict]:
        """One entry per group: name, state, restarts, where its ranks run, and its engine counters."""
        with self._mu:
            items = [(g, self.state[g], self.groups.get(g)) for g in self.state]
        routed = next((groups for groups in self._router_groups() if groups is not None), {})
        out = []
        for name, state, group in items:
            entry: dict = {
                "name": name,
                "state": state,
                "tp": self.template.tp,
                "restarts": self.restarts.get(name, 0),
                "router": routed.get(name),
            }
            if group is not None and group.ranks:
                try:
                    entry["ranks"] = group.rank_infos(timeout_s=10)
                    s = group.stats(timeout_s=10)
                    entry["stats"] = {
                        "running": s.running,
                        "waiting": s.waiting,
                        "blocks_pinned": s.blocks_pinned,
                        "blocks_cached": s.blocks_cached,
                        "blocks_free": s.blocks_free,
                        "requests": sum(p.requests for p in s.prefix_cache.values()),
                        # steps that computed a batch, their wall and engine-thread CPU seconds (per step: divide)
                        "steps": s.steps,
                        "step_seconds": round(s.step_seconds, 6),
                        "step_cpu_seconds": round(s.step_cpu_seconds, 6),
                    }
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}"
            out.append(entry)
        return out

    def status(self) -> dict:
        """What the supervisor knows now, without asking anyone (the admin API's /v1/status): every group's state
        and restarts, and Redis's state at its last check."""
        with self._mu:
            groups = [{"name": g, "state": str(s), "restarts": self.restarts.get(g, 0)} for g, s in self.state.items()]
        return {"groups": sorted(groups, key=lambda g: (len(g["name"]), g["name"])), "redis": self.redis_state}

    def serving_groups(self) -> dict[str, RankHandle]:
        """The serving groups and their leaders (what a restarted router replica asks for)."""
        with self._mu:
            return {g: self.groups[g].leader for g, s in self.state.items() if s == SERVING}

    def serving_nodes(self) -> dict[str, str]:
        """Each serving group's node: its address (else its id), from the group's placement group (all its ranks
        are on one node). Cheap (two GCS reads, no call into a group): `kvgrid serve` polls it while its groups
        start, to report each as it comes up."""
        with self._mu:
            names = [g for g, s in self.state.items() if s == SERVING]
        if not names:
            return {}
        addresses = {n["NodeID"]: n.get("NodeManagerAddress") or n["NodeID"] for n in ray.nodes()}
        placed = {
            info.get("name"): info.get("bundles_to_node_id") or {}
            for info in placement_group_table().values()
            if info.get("state") != "REMOVED"
        }
        out = {}
        for name in names:
            node = next(iter(placed.get(pg_name(name), {}).values()), None)
            out[name] = addresses.get(node, node) if node else "unknown"
        return out

    def info(self) -> dict:
        """Where the supervisor runs (its process id changes when Ray restarts it)."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "restarted": restarted()}

    def shutdown(self) -> None:
        """Stop watching and stop every group, then remove any group actor or placement group still left
        (one that a scale was starting meanwhile, or one this incarnation never knew of)."""
        self._stop.set()
        with self._mu:
            groups = list(self.groups.values())
            self.groups.clear()
            self.state.clear()
        for g in groups:
            g.shutdown()
        WorkerGroup.remove_all()


def _log(message: str, level: int = logging.INFO) -> None:
    log.log(level, message)
