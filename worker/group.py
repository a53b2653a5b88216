"""A worker group: ``tp`` Ray actors in one STRICT_PACK placement group that serve as one engine.

Rank 0 (the leader) owns the scheduler, the block pool and the key map and runs the engine; each step it
broadcasts the step's plan and every rank computes its shard of the model (``torch.distributed``: NCCL on CUDA,
gloo on CPU). The router talks to the group through ``WorkerGroup``: stream a request's outputs, abort it,
read the group's load and drain its KV events (each through its ``GroupClient``, ``worker/group_client.py``). The
ranks are ``RankActor``s (``worker/rank_actor.py``); this module places and starts them. If any rank dies the
group turns unhealthy, fails its in-flight requests with ``GroupUnhealthyError``, and ``restart()`` brings it back
as a whole.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import ray
from ray.exceptions import RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.defaults import DEFAULT_PIN_TTL_S
from common.errors import GroupUnhealthyError
from common.events import KVEvent
from common.outputs import RequestOutput
from common.protocol import RankHandle, Submit
from common.sampling import SamplingParams
from common.stats import EngineStats
from worker.engine import EngineConfig
from worker.group_client import GroupClient
from worker.rank_actor import RankActor

_log = logging.getLogger(__name__)


@dataclass
class GroupConfig:
    name: str
    engine: EngineConfig
    tp: int = 1
    use_gpu: bool = False  # one GPU per rank (NCCL); otherwise CPU bundles (gloo)
    event_stream_url: str | None = None  # also publish KV events to this Redis (one stream per group)
    start_timeout_s: float = 300.0
    accelerator: str | None = None  # resource each rank takes one of: "GPU" with use_gpu, or a custom one
    # Intra-op threads each rank computes its steps with. Ray reserves one CPU per rank whatever this is, so
    # groups stay placeable on a small machine; size it to the cores the node really has for its ranks.
    cpus_per_rank: int = 1
    # Rank 0's engine steps in a child process of the rank (worker/engine_process.py), away from the actor's
    # event loop and Ray's threads; False (the default): on a thread of the rank actor itself.
    engine_process: bool = False


class WorkerGroup:
    """Driver-side handle of one group (what the router holds)."""

    CALL_TIMEOUT_S = GroupClient.CALL_TIMEOUT_S

    def __init__(self, config: GroupConfig, start: bool = True) -> None:
        self.config = config
        self.ranks: list[RankHandle] = []
        self.rank_info: list[dict] = []
        self._pg: PlacementGroup | None = None
        self._follows: list[ray.ObjectRef] = []
        self._client: GroupClient | None = None  # of the current leader (a restart makes a new one)
        if start:
            self.start()

    @classmethod
    def adopt(cls, config: GroupConfig) -> WorkerGroup | None:
        """A handle on the group ``config.name`` that a previous owner started (its ranks and placement group
        are detached and named, so they outlive that owner): found by name, nothing is started. None when its
        placement group is gone. A rank that is gone shows in ``health()``, and ``restart()`` replaces them all."""
        try:
            pg = get_placement_group(pg_name(config.name))
        except ValueError:
            return None
        if placement_group_table(pg).get("state") == "REMOVED":
            return None
        group = cls(config, start=False)
        group._pg = pg
        for r in range(config.tp):
            try:
                group.ranks.append(ray.get_actor(rank_name(config.name, r)))
            except ValueError:  # not started yet, or dead: the group is incomplete
                break
        return group

    @staticmethod
    def remove_all() -> list[str]:
        """Kill every kvgrid rank actor and remove every kvgrid placement group of this Ray namespace, whoever
        started them (they are detached: nothing else frees them). Returns what was removed."""
        removed = []
        for name in ray.util.list_named_actors():
            if _RANK_NAME.fullmatch(name):
                try:
                    ray.kill(ray.get_actor(name), no_restart=True)
                    removed.append(name)
                except ValueError:  # it died meanwhile
                    pass
        names = {info.get("name", "") for info in placement_group_table().values() if info.get("state") != "REMOVED"}
        for name in sorted(n for n in names if n.startswith("kvgrid-")):
            try:
                remove_placement_group(get_placement_group(name))  # only this namespace's
                removed.append(name)
            except ValueError:  # another namespace's, or removed meanwhile
                pass
        return removed

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def leader(self) -> RankHandle:
        return self.ranks[0]

    @property
    def client(self) -> GroupClient:
        """The client of this group's current leader (every call into the group goes through it)."""
        if self._client is None or self._client.leader != self.leader:
            self._client = GroupClient(self.name, self.leader)
        return self._client

    def start(self) -> None:
        """Reserve the group's placement group and start its ranks; on any failure nothing stays reserved."""
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        cfg = self.config
        accel = cfg.accelerator or ("GPU" if cfg.use_gpu else None)
        per_rank = {"CPU": 1, accel: 1} if accel else {"CPU": 1}
        # Groups start in parallel (Supervisor.scale); each picks its node from the placement groups already
        # placed, so one picks and is placed at a time: two would otherwise pick the same emptiest node.
        with _PLACING:
            node = self._target_node(accel or "CPU")
            # Detached (like the ranks): the group outlives a crash of the supervisor that started it, which
            # adopts it again by name when Ray restarts it. ``shutdown()`` and ``remove_all()`` free them.
            pg = self._pg = placement_group(
                [per_rank] * cfg.tp,
                strategy="STRICT_PACK",
                name=pg_name(cfg.name),
                bundle_label_selector=[{"ray.io/node-id": node}] * cfg.tp,
                lifetime="detached",
            )
            ray.get(pg.ready(), timeout=cfg.start_timeout_s)
        actor = ray.remote(RankActor)
        self.ranks = [
            actor.options(
                num_cpus=1,
                num_gpus=1 if accel == "GPU" else 0,
                resources={accel: 1} if accel and accel != "GPU" else None,
                name=rank_name(cfg.name, r),
                lifetime="detached",
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
            ).remote(r, cfg.tp, cfg.cpus_per_rank)
            for r in range(cfg.tp)
        ]
        init_method = ray.get(self.leader.address.remote(), timeout=cfg.start_timeout_s)
        backend = "nccl" if cfg.use_gpu else "gloo"
        self.rank_info = ray.get(
            [
                a.setup.remote(cfg.engine, init_method, backend, cfg.name, cfg.event_stream_url, cfg.engine_process)
                for a in self.ranks
            ],
            timeout=cfg.start_timeout_s,
        )
        self._follows = [a.follow.remote() for a in self.ranks[1:]]

    def _target_node(self, resource: str) -> str:
        """The node for this group: one with ``tp`` units of ``resource`` not reserved by other kvgrid groups,
        preferring the most free, then the fewest kvgrid groups, so groups spread over nodes. A group never
        waits for a node that cannot hold it whole."""
        reserved: dict[str, float] = defaultdict(float)
        groups_on: dict[str, int] = defaultdict(int)
        for pg in placement_group_table().values():
            if not pg.get("name", "").startswith("kvgrid-") or pg.get("state") == "REMOVED":
                continue
            for index, node in pg["bundles_to_node_id"].items():
                reserved[node] += pg["bundles"][index].get(resource, 0)
            for node in set(pg["bundles_to_node_id"].values()):
                groups_on[node] += 1
        best: tuple[float, int, str] | None = None
        for n in ray.nodes():
            if not n["Alive"]:
                continue
            free = n["Resources"].get(resource, 0) - reserved[n["NodeID"]]
            if free >= self.config.tp and (best is None or (free, -groups_on[n["NodeID"]]) > best[:2]):
                best = (free, -groups_on[n["NodeID"]], n["NodeID"])
        if best is None:
            raise RuntimeError(
                f"worker group {self.config.name!r} needs {self.config.tp} x {resource} on one node; "
                "no node has them free"
            )
        return best[2]

    def health(self) -> str | None:
        """None when every rank is alive and the leader reports no failure, else the reason."""
        if not self.ranks:
            return "not running"
        if len(self.ranks) < self.config.tp:  # adopted incomplete
            return f"rank {len(self.ranks)} is gone"
        if not self._follows:  # adopted: the followers' ``follow`` calls belong to the previous owner
            for r in range(1, self.config.tp):
                try:
                    ray.get_actor(rank_name(self.name, r))  # a dead rank's name is free again
                except ValueError:
                    reason = f"rank {r} is gone"
                    self._tell_leader(reason)
                    return reason
        done, _ = ray.wait(self._follows, num_returns=len(self._follows), timeout=0) if self._follows else ([], [])
        for ref in done:  # a follower only returns early when its rank died or the group broke
            reason = f"rank {self._follows.index(ref) + 1} stopped"
            try:
                ray.get(ref)
            except RayError as exc:
                reason = f"rank {self._follows.index(ref) + 1} died: {type(exc).__name__}"
            self._tell_leader(reason)
            return reason
        try:
            return self.client.health(timeout_s=30)
        except (GroupUnhealthyError, TimeoutError) as exc:  # dead, or too stuck to answer
            return f"rank 0 is not answering: {type(exc.__cause__ or exc).__name__}"

    def _tell_leader(self, reason: str) -> None:
        try:
            self.client.mark_unhealthy(reason, timeout_s=30)
        except (GroupUnhealthyError, TimeoutError):
            pass

    def rank_infos(self, timeout_s: float = 10.0) -> list[dict]:
        """Where each rank runs (``RankActor.info``), asked of all ranks at once."""
        return ray.get([r.info.remote() for r in self.ranks], timeout=timeout_s)

    def stream(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        tenant: str = "default",
        request_id: str | None = None,
        pin_tokens: int = 0,
        pin_ttl_s: float = DEFAULT_PIN_TTL_S,
    ) -> Iterator[RequestOutput]:
        """Outputs of one request as the group produces them (blocking iterator)."""
        return self.client.stream(_submit(prompt, params, tenant, request_id, pin_tokens, pin_ttl_s))

    def astream(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        tenant: str = "default",
        request_id: str | None = None,
        pin_tokens: int = 0,
        pin_ttl_s: float = DEFAULT_PIN_TTL_S,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the group produces them, over this event loop's one subscription to the
        leader (what a gateway replica does)."""
        return self.client.astream(_submit(prompt, params, tenant, request_id, pin_tokens, pin_ttl_s))

    def generate(
        self, prompt: list[int], params: SamplingParams | None = None, tenant: str = "default"
    ) -> RequestOutput:
        """Run one request to completion."""
        return self.client.run(_submit(prompt, params, tenant))

    def abort(self, request_id: str, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        return self.client.abort(request_id, timeout_s)

    def stats(self, timeout_s: float = CALL_TIMEOUT_S) -> EngineStats:
        """The leader's engine counters; ``TimeoutError`` when it does not answer within ``timeout_s``."""
        return self.client.stats(timeout_s)

    def read_events(self, offset: int, timeout_s: float = CALL_TIMEOUT_S) -> tuple[list[KVEvent], int]:
        """KV events from ``offset`` on and the next offset (see ``RankActor.read_events``)."""
        return self.client.read_events(offset, timeout_s)

    def pinned_entries(self, timeout_s: float = CALL_TIMEOUT_S) -> list[tuple[str, list[int], float]]:
        """The explicit cache entries pinned in this group (see ``RankActor.pinned_entries``)."""
        return self.client.pinned_entries(timeout_s)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank and free the placement group (``graceful``: first let the followers return, for
        at most 10 s; pointless when the group is known to hang)."""
        if graceful and self.ranks:
            try:
                self.client.shutdown(timeout_s=10)
                # The followers return from ``follow`` once their disk writes are done: wait for that before killing.
                ray.wait(self._follows, num_returns=len(self._follows), timeout=10)
            except Exception:  # the group may already be broken; killing below is what matters
                pass
        for a in self.ranks:
            try:
                ray.kill(a, no_restart=True)
            except ValueError:  # already gone
                pass
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:  # the GCS did not answer: remove_all() at exit still finds it by name
                _log.warning("could not remove the placement group of %s: %s", self.name, exc)
        self.ranks, self._follows, self._pg, self._client = [], [], None, None

    def restart(self) -> None:
        """Replace the whole group (all ranks) with fresh actors; its cache starts empty."""
        self.shutdown()
        self.start()


def _submit(
    prompt: list[int],
    params: SamplingParams | None,
    tenant: str,
    request_id: str | None = None,
    pin_tokens: int = 0,
    pin_ttl_s: float = DEFAULT_PIN_TTL_S,
) -> Submit:
    return Submit(list(prompt), params or SamplingParams(), tenant, request_id, pin_tokens, pin_ttl_s)


def pg_name(group: str) -> str:
    return f"kvgrid-{group}"


def rank_name(group: str, rank: int) -> str:
    return f"kvgrid-{group}-rank{rank}"


_PLACING = threading.Lock()  # WorkerGroup._start: one group chooses its node and is placed at a time
_RANK_NAME = re.compile(r"kvgrid-.+-rank[0-9]+")
RAY_NAMESPACE = "kvgrid"  # where the named (detached) group actors live, so a restarted supervisor finds them


def init_local_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    """Start (or join, with ``address``) Ray in the kvgrid namespace; a local start stays on loopback with auth
    disabled."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts its workers at nice 15 unless told otherwise: every actor of kvgrid (the ranks' engine threads
    # first) would give way to any process at the default priority on the node (a load generator, a log
    # shipper). On 2 cores under 32 streams the engine thread waited for a core 22% of the time either way (its
    # competitors are kvgrid's own actors), and 6% when given priority over everything (nice -10, root only).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # A CPU rank's OpenMP threads sleep as soon as a parallel region ends instead of spinning for the next one
    # on the cores the HTTP path needs (on 2 cores under 32 streams a rank's second thread spun about 0.1 core
    # away). Set here, inherited by every Ray worker, rather than as a per-actor runtime_env, which makes Ray
    # start a dedicated worker process for each rank through its runtime-env agent.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Ray reports every actor call's state changes (for its dashboard's task list and `ray list tasks`, which
    # kvgrid does not use) from each process: a request makes several calls and a stream one message per step.
    # Off, the HTTP figures on 2 cores were 3-9% higher in four A/B pairs (8 and 32 streams). Set the variable
    # to a positive interval (ms) to have them again.
    os.environ.setdefault("RAY_task_events_report_interval_ms", "0")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
    else:
        ray.init(
            address="local",  # always a new instance: never join another Ray running on this machine
            namespace=RAY_NAMESPACE,
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=256 * 2**20,
            log_to_driver=False,
        )
