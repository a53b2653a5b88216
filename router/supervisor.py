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
from ray.exceptions import RayError

from common.sampling import SamplingParams
from worker.group import GroupConfig, WorkerGroup

STARTING, SERVING, DRAINING, RESTARTING, FAILED = "starting", "serving", "draining", "restarting", "failed"


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
        (the ones named in ``remove`` first, then the newest). Returns ``describe()``."""
        if groups < 1:
            raise ValueError("groups must be >= 1 (drain a deployment by stopping kvgrid serve)")
        if self.max_groups is not None and groups > self.max_groups:
            raise ValueError(f"groups must be <= {self.max_groups} (max_groups in the config)")
        with self._scaling:
            with self._mu:
                active = [g for g, s in self.state.items() if s != DRAINING]
            unknown = [g for g in remove if g not in active]
            if unknown:
                raise ValueError(f"no such worker group: {', '.join(unknown)} (groups: {', '.join(active)})")
            surplus = len(active) - groups
            if len(set(remove)) > max(0, surplus):
                raise ValueError(f"remove names {len(set(remove))} group(s) but scaling to {groups} removes "
                                 f"{max(0, surplus)}")
            for _ in range(-surplus):
                self._add()
            victims = list(dict.fromkeys(remove)) + [g for g in reversed(active) if g not in remove]
            for name in victims[:max(0, surplus)]:
                self._drain(name, self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s)
        return self.describe()

    def _add(self) -> str:
        with self._mu:
            name = f"g{self._next}"
            self._next += 1
            self.state[name] = STARTING
        try:
            group = WorkerGroup(dataclasses.replace(self.template, name=name))
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
            self.state[name] = DRAINING
        self._tell_routers("pause_group", name)
        _log(f"draining group {name}")
        moved = self._move_pins(name, group)
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
        self._tell_routers("remove_group", name)  # its index entries go with it
        group.shutdown()
        self._drop_stream(name)
        with self._mu:
            self.groups.pop(name, None)
            self.state.pop(name, None)
        _log(f"group {name} drained and removed ({moved} pinned entries moved)")

    def _move_pins(self, name: str, group: WorkerGroup) -> int:
        """Recompute and pin the draining group's explicit cache entries on the groups the router picks now."""
        try:
            entries = ray.get(group.leader.pinned_entries.remote(), timeout=60)
        except RayError:
            return 0
        moved = 0
        for tenant, tokens, ttl_s in sorted(entries, key=lambda e: -len(e[1])):  # longest first: covers the rest
            try:
                decision = ray.get(self.router.route.remote(tenant, tokens, None, [name]))
                try:
                    params = SamplingParams(max_tokens=1, temperature=0.0)
                    for ref in decision.leader.generate.remote(tokens, params, tenant, decision.request_id,
                                                               len(tokens), ttl_s):
                        ray.get(ref)
                finally:
                    self.router.on_finish.remote(decision.request_id)
                moved += 1
            except Exception as exc:  # the entry is lost on this group only: it is recomputed on next use
                _log(f"group {name}: could not move a pinned entry ({type(exc).__name__})")
        return moved

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
        ray.get([getattr(r, method).remote(*args) for r in self.routers])

    # -- failures ---------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            try:
                self.check()
            except Exception as exc:  # never let the watcher die
                _log(f"health check failed: {type(exc).__name__}: {exc}")

    def check(self) -> None:
        """Restart every serving group that has failed; resume routing to a paused group found healthy."""
        with self._mu:
            serving = [(g, self.groups[g]) for g, s in self.state.items() if s in (SERVING, FAILED)]
        if not serving:
            return
        paused = {g for r in ray.get([r.groups.remote() for r in self.routers]) for g, info in r.items()
                  if info["paused"]}
        for name, group in serving:
            reason = group.health()
            if reason is None:
                if name in paused:
                    self._tell_routers("pause_group", name, False)
                continue
            with self._mu:
                if self.state.get(name) not in (SERVING, FAILED):
                    continue  # a drain took it meanwhile
                self.state[name] = RESTARTING
            _log(f"group {name} failed ({reason}); restarting it")
            # Its cache is gone: drop the group and its index entries now, re-add it once it serves again.
            self._tell_routers("remove_group", name)
            try:
                group.restart()
            except Exception as exc:
                with self._mu:
                    self.state[name] = FAILED
                _log(f"group {name} could not restart: {type(exc).__name__}: {exc}")
                continue
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
        routed = ray.get(self.router.groups.remote())
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

    def leaders(self) -> dict:
        with self._mu:
            return {g: grp.leader for g, grp in self.groups.items() if self.state.get(g) == SERVING}

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
