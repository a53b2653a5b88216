"""The supervisor: owns a deployment's worker groups. It starts them, adds and drains groups when asked to scale,
and restarts a group that fails. It runs as a threaded Ray actor beside the router and tells the router which
groups exist; the router never starts or stops a group itself.

Draining a group: the router stops sending it new requests, its explicit cache entries (pins) are recomputed and
pinned on the groups that will hold them from now on, its in-flight requests run to the end, then the router
drops the group and every index entry it had, and the group's actors and placement group go away.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import ray

from common.sampling import SamplingParams
from worker.group import GroupConfig, WorkerGroup

STARTING, SERVING, DRAINING, RESTARTING, FAILED = "starting", "serving", "draining", "restarting", "failed"
ROUTER_TIMEOUT_S = 30.0
RECOMPUTE_TIMEOUT_S = 300.0  # one output of a pinned entry's recompute on another group


class Supervisor:
    def __init__(
        self,
        template: GroupConfig,
        routers: list,
        redis_url: str | None = None,
        health_interval_s: float = 1.0,
        drain_timeout_s: float = 120.0,
        max_groups: int | None = None,
    ) -> None:
        self.template = template
        self.routers = list(routers)  # the RouterService replicas: each learns of every group change
        self.router = self.routers[0]  # the one that places moved pins
        self.redis_url = redis_url
        self.health_interval_s = health_interval_s
        self.drain_timeout_s = drain_timeout_s
        self.max_groups = max_groups
        self.groups: dict[str, WorkerGroup] = {}
        self.state: dict[str, str] = {}
        self.restarts: dict[str, int] = {}
        self._next = 0
        self._mu = threading.Lock()  # guards the two dicts above; never held across a remote call
        self._scaling = threading.Lock()  # one scale operation at a time
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="kvgrid-supervisor-health", daemon=True)
        self._watcher.start()

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
                raise ValueError(f"remove names {len(set(remove))} group(s) but scaling to {groups} removes "
                                 f"{max(0, surplus)}")
            for _ in range(-surplus):
                self._add()
            victims = list(dict.fromkeys(remove)) + [g for g in reversed(serving) if g not in remove]
            for name in victims[:max(0, surplus)]:
                self._drain(name, self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s)
        return self.describe()

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
        self._tell_routers("add_group", name, group.leader)  # from now on it receives requests
        with self._mu:
            self.state[name] = SERVING
        _log(f"group {name} is serving")
        return name

    def _drain(self, name: str, timeout_s: float) -> None:
        with self._mu:
            group = self.groups[name]
            self.state[name] = DRAINING  # from now on the health check leaves it alone
        self._tell_routers("pause_group", name)
        _log(f"draining group {name}")
        moved: set[tuple[str, tuple[int, ...]]] = set()
        self._move_pins(name, group, moved)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                s = group.stats()
            except Exception:  # the group died while draining: nothing left to wait for
                break
            if s.running == 0 and s.waiting == 0:
                break
            time.sleep(0.05)
        else:
            _log(f"group {name}: requests still running after {timeout_s:.0f} s; they fail now")
        self._move_pins(name, group, moved)  # pins made by the requests that were still running
        self._release(name)
        _log(f"group {name} drained and removed ({len(moved)} pinned entries moved)")

    def _release(self, name: str) -> None:
        """Drop a group from the routers (with its index entries) and free its actors and placement group."""
        self._tell_routers("remove_group", name)
        with self._mu:
            group = self.groups.pop(name, None)
            self.state.pop(name, None)
        if group is not None:
            group.shutdown()
        self._drop_stream(name)

    def _move_pins(self, name: str, group: WorkerGroup, moved: set) -> None:
        """Recompute and pin the draining group's explicit cache entries on the groups the router picks now
        (each entry once: ``moved`` remembers them)."""
        try:
            entries = ray.get(group.leader.pinned_entries.remote(), timeout=60)
        except Exception:
            return
        for tenant, tokens, ttl_s in sorted(entries, key=lambda e: -len(e[1])):  # longest first: covers the rest
            if (tenant, tuple(tokens)) in moved:
                continue
            try:
                decision = ray.get(self.router.route.remote(tenant, tokens, None, [name]), timeout=30)
                try:
                    params = SamplingParams(max_tokens=1, temperature=0.0)
                    for ref in decision.leader.generate.remote(tokens, params, tenant, decision.request_id,
                                                               len(tokens), ttl_s):
                        ray.get(ref, timeout=RECOMPUTE_TIMEOUT_S)
                finally:
                    self.router.on_finish.remote(decision.request_id)
                moved.add((tenant, tuple(tokens)))
            except Exception as exc:  # the entry is lost on this group only: it is recomputed on next use
                _log(f"group {name}: could not move a pinned entry ({type(exc).__name__})")

    def _drop_stream(self, name: str) -> None:
        if not self.redis_url:
            return
        import redis

        from common.event_stream import stream_name

        try:
            redis.Redis.from_url(self.redis_url).delete(stream_name(name))
        except redis.RedisError:
            pass

    def _tell_routers(self, method: str, *args) -> None:
        """Call ``method`` on every router replica; a replica that fails or does not answer is logged, not fatal."""
        refs = [getattr(r, method).remote(*args) for r in self.routers]
        for ref in refs:
            try:
                ray.get(ref, timeout=ROUTER_TIMEOUT_S)
            except Exception as exc:
                _log(f"router replica: {method}({args[0]}) failed ({type(exc).__name__})")

    # -- failures ---------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check()
            except Exception as exc:  # never let the watcher die
                _log(f"health check failed: {type(exc).__name__}: {exc}")

    def check(self) -> None:
        """Restart every serving group that has failed (and retry failed restarts); resume routing to a group
        that was reported failed but is healthy."""
        with self._mu:
            watched = [(g, self.groups[g]) for g, s in self.state.items() if s in (SERVING, FAILED)]
        if not watched:
            return
        paused: set[str] = set()
        for r in self.routers:
            try:
                paused |= {g for g, info in ray.get(r.groups.remote(), timeout=ROUTER_TIMEOUT_S).items()
                           if info["paused"]}
            except Exception as exc:  # a replica that does not answer must not stop the health checks
                _log(f"a router replica did not answer ({type(exc).__name__})")
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
                self._tell_routers("pause_group", name, False)
                with self._mu:
                    drained = self.state.get(name) != SERVING
                if drained:  # a drain paused it meanwhile: it must stay paused
                    self._tell_routers("pause_group", name)

    def _restart(self, name: str, group: WorkerGroup, reason: str) -> None:
        _log(f"group {name} failed ({reason}); restarting it")
        # Its cache is gone: drop the group and its index entries now, re-add it once it serves again.
        self._tell_routers("remove_group", name)
        try:
            group.restart()
        except Exception as exc:
            with self._mu:
                if self.state.get(name) == RESTARTING:
                    self.state[name] = FAILED  # retried at the next check
            _log(f"group {name} could not restart: {type(exc).__name__}: {exc}")
            return
        with self._mu:
            if self.state.get(name) != RESTARTING:
                return
        self._tell_routers("add_group", name, group.leader)
        with self._mu:
            self.state[name] = SERVING
            self.restarts[name] = self.restarts.get(name, 0) + 1
        _log(f"group {name} restarted and serving")

    # -- inspection -------------------------------------------------------------------------------------------

    def describe(self) -> list[dict]:
        """One entry per group: name, state, restarts, where its ranks run, and its engine counters."""
        with self._mu:
            items = [(g, self.state[g], self.groups.get(g)) for g in self.state]
        try:
            routed = ray.get(self.router.groups.remote(), timeout=ROUTER_TIMEOUT_S)
        except Exception:
            routed = {}
        out = []
        for name, state, group in items:
            entry: dict = {"name": name, "state": state, "tp": self.template.tp,
                           "restarts": self.restarts.get(name, 0), "router": routed.get(name)}
            if group is not None and group.ranks:
                try:
                    entry["ranks"] = ray.get([r.info.remote() for r in group.ranks], timeout=10)
                    s = group.stats()
                    entry["stats"] = {
                        "running": s.running, "waiting": s.waiting, "blocks_pinned": s.blocks_pinned,
                        "blocks_cached": s.blocks_cached, "blocks_free": s.blocks_free,
                        "requests": sum(p.requests for p in s.prefix_cache.values()),
                    }
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}"
            out.append(entry)
        return out

    def shutdown(self) -> None:
        """Stop watching and stop every group."""
        self._stop.set()
        with self._mu:
            groups = list(self.groups.values())
            self.groups.clear()
            self.state.clear()
        for g in groups:
            g.shutdown()


def _log(message: str) -> None:
    print(f"kvgrid supervisor: {message}", flush=True)
