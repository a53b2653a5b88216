"""The router as a Ray component: one ``RouterService`` actor per replica, each with its own index copy. Events
come from the groups' Redis streams when ``redis_url`` is given (a replica started late reads the streams from
their start, and takes a snapshot from the group where history was trimmed), else from each group's own event
log over Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from router.policy import GroupLoad
from router.router import RouteDecision, Router


class RouterService:
    """Async routing for the gateways. ``leaders`` maps each group to its rank-0 actor handle."""

    def __init__(
        self,
        leaders: dict,
        secret: bytes | str,
        block_size: int = 16,
        policy: str = "kvgrid",
        hash_algo: str = "xxh3_128",
        poll_interval_s: float = 0.02,
        redis_url: str | None = None,
        max_queued_prefill_tokens: int | None = None,
        tenant_shares: dict[str, float] | None = None,
    ) -> None:
        self.router = Router(
            list(leaders), secret, block_size, policy, hash_algo, max_queued_prefill_tokens=max_queued_prefill_tokens,
            tenant_shares=tenant_shares,
        )
        self.leaders = dict(leaders)
        self.offsets = {g: 0 for g in leaders}
        self.stream = None
        if redis_url:
            import redis

            from common.event_stream import RedisStreamSubscription

            self.stream = RedisStreamSubscription(redis.Redis.from_url(redis_url), list(leaders))
        self.poll_interval_s = poll_interval_s
        self._poller: asyncio.Task | None = None

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        delay = self.poll_interval_s
        while True:
            try:
                await self.poll()
                delay = self.poll_interval_s
            except Exception as exc:  # Redis or a group briefly unreachable: keep the index, retry later
                delay = min(2.0, delay * 2)
                print(f"kvgrid router: event poll failed ({type(exc).__name__}: {exc}); retrying", flush=True)
            await asyncio.sleep(delay)

    async def poll(self) -> int:
        """Read every group's new events into this replica's index; returns how many. Also starts the
        background poller."""
        self._ensure_poller()
        if self.stream is not None:
            return await self._poll_stream()
        groups = list(self.leaders)
        replies = await asyncio.gather(
            *(self.leaders[g].read_events.remote(self.offsets[g]) for g in groups), return_exceptions=True
        )
        n = 0
        for g, reply in zip(groups, replies):
            if isinstance(reply, BaseException) or g not in self.leaders:
                continue  # a dead group: the supervisor removes or restarts it
            events, self.offsets[g] = reply
            for e in events:
                self.router.apply_event(g, e)
            n += len(events)
        return n

    async def _poll_stream(self) -> int:
        assert self.stream is not None
        batch = self.stream.poll()
        for group, event in batch:
            if group in self.leaders:
                self.router.apply_event(group, event)
        for group in list(self.stream.needs_resync):
            leader = self.leaders.get(group)
            if leader is not None:
                events, _ = await leader.read_events.remote(-1)  # an impossible offset: a snapshot
                for event in events:
                    self.router.apply_event(group, event)
            self.stream.needs_resync.discard(group)  # only once the snapshot is in
        return len(batch)

    async def route(
        self, tenant: str, token_ids: Sequence[int], request_id: str | None = None, exclude: Sequence[str] = ()
    ) -> RouteDecision:
        """A group for the request, with its leader's handle (groups come and go: callers keep no list)."""
        self._ensure_poller()
        decision = self.router.route(tenant, token_ids, request_id, exclude)
        decision.leader = self.leaders[decision.group]
        return decision

    def report_failure(self, group: str, reason: str) -> None:
        """A caller saw ``group`` fail: route nothing more to it until the supervisor has restarted it."""
        if group in self.router.loads:
            self.router.pause_group(group)
            print(f"kvgrid router: group {group} paused after a failure ({reason})", flush=True)

    def pause_group(self, group: str, paused: bool = True) -> None:
        """Stop (or resume) routing to ``group``; a group this replica does not know is ignored."""
        if group in self.router.loads:
            self.router.pause_group(group, paused)

    def groups(self) -> dict[str, dict]:
        """Per group: whether it is paused, its load, and how many keys the index holds for it."""
        held = self.router.index.key_counts()
        return {g: {"paused": g in self.router.paused, "index_keys": held.get(g, 0),
                    "queued_prefill_tokens": load.queued_prefill_tokens, "running": load.running}
                for g, load in self.router.loads.items()}

    def index_key_counts(self) -> dict[str, int]:
        """Keys the index holds per group, counted from the index itself (``"?"``: bits of no known group)."""
        return self.router.index.key_counts()

    def leaders_now(self) -> dict:
        return dict(self.leaders)

    def on_prefill_done(self, request_id: str) -> None:
        self.router.on_prefill_done(request_id)

    def on_finish(self, request_id: str) -> None:
        self.router.on_finish(request_id)

    def match(self, tenant: str, token_ids: Sequence[int]) -> dict[str, int]:
        """Leading blocks each group holds for this prompt (for inspection and tests)."""
        return self.router.match(self.router.keys_for(tenant, token_ids))

    def loads(self) -> dict[str, GroupLoad]:
        return dict(self.router.loads)

    def add_group(self, group: str, leader) -> None:
        self.leaders[group], self.offsets[group] = leader, 0
        self.router.add_group(group)
        if self.stream is not None:
            self.stream.add_group(group)

    def remove_group(self, group: str) -> None:
        self.leaders.pop(group, None)
        self.offsets.pop(group, None)
        self.router.remove_group(group)
        if self.stream is not None:
            self.stream.remove_group(group)
