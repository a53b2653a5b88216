"""Typed clients of the router's actors: a router replica (``router.routing.service.RouterService``) and the
supervisor (``router.control.supervisor.Supervisor``). Each wraps the raw Ray actor handle and has one method per
actor method its callers use, with the actor method's arguments and result: the call is the handle's
``.remote(...)`` (nothing more: no timeout, no retry), and the ``ObjectRef`` it returns is awaited (async callers)
or passed to ``ray.get`` (sync ones) as before, now typed with what the actor answers. A group's leader has its
own client, ``worker.group_client.GroupClient``.

The handle is typed ``Any`` here and only here (see ``common.protocol.RankHandle``: ray types a handle's method
attributes as ``Never``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray import ObjectRef

    from common.protocol import RankHandle, RouterHandle, SupervisorHandle
    from router.routing.router import RouteDecision, RouteNote


class RouterClient:
    """One router replica. ``handle``: its actor handle (or a test's stand-in with the same ``.remote`` methods)."""

    __slots__ = ("handle",)

    def __init__(self, handle: RouterHandle) -> None:
        self.handle: Any = handle

    @classmethod
    def of(cls, router: RouterHandle | RouterClient) -> RouterClient:
        """``router`` as a client (itself when it is one already)."""
        return router if isinstance(router, RouterClient) else cls(router)

    def route(
        self,
        tenant: str,
        token_ids: Sequence[int],
        request_id: str | None = None,
        exclude: Sequence[str] = (),
        cache_key: str | None = None,
        n: int = 1,
        adapter: str | None = None,
    ) -> ObjectRef[RouteDecision]:
        return self.handle.route.remote(tenant, token_ids, request_id, exclude, cache_key, n, adapter)

    def forget_tenant(self, tenant: str) -> ObjectRef[dict[str, list[int]]]:
        return self.handle.forget_tenant.remote(tenant)

    def cancel_route(self, request_id: str) -> ObjectRef[None]:
        return self.handle.cancel_route.remote(request_id)

    def on_finish(self, request_id: str) -> ObjectRef[None]:
        return self.handle.on_finish.remote(request_id)

    def report(self, events: Sequence[tuple[str, str | RouteNote]]) -> ObjectRef[None]:
        return self.handle.report.remote(events)

    def report_failure(self, group: str, reason: str) -> ObjectRef[None]:
        return self.handle.report_failure.remote(group, reason)

    def add_group(self, group: str, leader: RankHandle) -> ObjectRef[None]:
        return self.handle.add_group.remote(group, leader)

    def remove_group(self, group: str) -> ObjectRef[None]:
        return self.handle.remove_group.remote(group)

    def pause_group(self, group: str, paused: bool = True) -> ObjectRef[None]:
        return self.handle.pause_group.remote(group, paused)

    def groups(self) -> ObjectRef[dict[str, dict]]:
        return self.handle.groups.remote()

    def poll(self) -> ObjectRef[int]:
        return self.handle.poll.remote()

    def index_key_counts(self) -> ObjectRef[dict[str, int]]:
        return self.handle.index_key_counts.remote()

    def info(self) -> ObjectRef[dict]:
        return self.handle.info.remote()

    def leaders_now(self) -> ObjectRef[dict[str, RankHandle]]:
        return self.handle.leaders_now.remote()

    def match(self, tenant: str, token_ids: Sequence[int]) -> ObjectRef[dict[str, int]]:
        return self.handle.match.remote(tenant, token_ids)


class SupervisorClient:
    """The supervisor. ``handle``: its actor handle."""

    __slots__ = ("handle",)

    def __init__(self, handle: SupervisorHandle) -> None:
        self.handle: Any = handle

    @classmethod
    def of(cls, supervisor: SupervisorHandle | SupervisorClient) -> SupervisorClient:
        """``supervisor`` as a client (itself when it is one already)."""
        return supervisor if isinstance(supervisor, SupervisorClient) else cls(supervisor)

    def scale(
        self, groups: int, remove: Sequence[str] = (), drain_timeout_s: float | None = None
    ) -> ObjectRef[list[dict]]:
        return self.handle.scale.remote(groups, remove, drain_timeout_s)

    def describe(self) -> ObjectRef[list[dict]]:
        return self.handle.describe.remote()

    def status(self) -> ObjectRef[dict]:
        return self.handle.status.remote()

    def info(self) -> ObjectRef[dict]:
        return self.handle.info.remote()

    def serving_groups(self) -> ObjectRef[dict[str, RankHandle]]:
        return self.handle.serving_groups.remote()

    def serving_nodes(self) -> ObjectRef[dict[str, str]]:
        return self.handle.serving_nodes.remote()

    def shutdown(self) -> ObjectRef[None]:
        return self.handle.shutdown.remote()
