"""The router as a Ray component: one ``RouterService`` actor per replica, each with its own index copy. Events
come from the groups' Redis streams when ``redis_url`` is given (a replica started late reads the streams from
their start, and takes a snapshot from the group where history was trimmed), else from each group's own event
log over Ray.

A replica keeps nothing that cannot be rebuilt: Ray restarts a dead one (``max_restarts``), it asks the
supervisor for the serving groups as it starts (and the supervisor's health check hands it any it lacks), and
each group's index comes back from the group's event stream."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.routing.adapters import ADAPTER_SLOTS
from router.routing.compact_index import CompactPrefixIndex
from router.routing.policy import make_policy
from router.routing.router import RouteDecision, RouteNote, Router
from router.routing.snapshot import IndexSnapshots, fingerprint

if TYPE_CHECKING:
    from common.protocol import RankHandle, SupervisorHandle

REDIS_TIMEOUT_S = 2.0  # a paused or unreachable Redis fails a poll after this long; routing goes on meanwhile
# The background poller's Redis read waits this long for a first new event (well below REDIS_TIMEOUT_S): an idle
# replica reads a few times a second instead of every poll interval, and a busy one still reads at most once per
# interval. A group added meanwhile is read from the next read on, at most this much later.
STREAM_WAIT_MS = 250
GROUP_CALL_TIMEOUT_S = 30.0  # a group's leader that does not hand over its events within this is skipped

_log = logging.getLogger(__name__)


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
        supervisor: str | None = None,
        policy_args: dict[str, float] | None = None,
        index: str = "compact",
        adapter_slots: int = ADAPTER_SLOTS,
        snapshot_path: str | None = None,
        snapshot_interval_s: float = 300.0,
        restore_snapshot: bool | None = None,
    ) -> None:
        """``snapshot_path``: where this replica writes its index every ``snapshot_interval_s`` (compact index and
        ``redis_url`` only; router/routing/snapshot.py), and, when Ray restarted it (``restore_snapshot`` None)
        or ``restore_snapshot`` is True, reads it back at the start."""
        if supervisor is not None:  # a replica of `kvgrid serve`: its warnings go to the console (common/log_relay.py)
            from common.log_relay import relay_logging

            relay_logging()
        # policy_args: the policy's settings (the serve config's routing: its tier load weights)
        self.router = Router(
            list(leaders),
            secret,
            block_size,
            make_policy(policy, 0, **(policy_args or {})),
            hash_algo,
            max_queued_prefill_tokens=max_queued_prefill_tokens,
            index=index,
            tenant_shares=tenant_shares,
        )
        self.router.adapters.slots = adapter_slots  # each group's LoRA slots (lora.max_loras)
        self.leaders = dict(leaders)
        self.offsets = {g: 0 for g in leaders}
        self.stream = None
        if redis_url:
            from common.event_stream import RedisStreamSubscription, stream_client

            client = stream_client(redis_url, REDIS_TIMEOUT_S)
            self.stream = RedisStreamSubscription(client, list(leaders))
        self.poll_interval_s = poll_interval_s
        self._poller: asyncio.Task | None = None
        self.snapshots: IndexSnapshots | None = None
        self.restored: dict | None = None  # what a snapshot brought back at the start (``info``)
        if snapshot_path is not None:
            if index != "compact" or self.stream is None:
                raise ValueError("router index snapshots need the compact index and the groups' Redis streams")
            self.snapshots = IndexSnapshots(
                snapshot_path, snapshot_interval_s, fingerprint(secret, block_size, hash_algo)
            )
        was_restarted = supervisor is not None and restarted()
        if self.snapshots is not None and (was_restarted if restore_snapshot is None else restore_snapshot):
            self._restore()
        if was_restarted:
            assert supervisor is not None
            self._recover_groups(supervisor)
            if self.restored is not None:  # groups of the snapshot that no longer serve: forgotten
                for group in set(self.restored["groups"]) - set(self.leaders):
                    self.remove_group(group)

    def _restore(self) -> None:
        """Load the last snapshot: the index, and the stream cursors it matches (a group added later reads its
        stream on from there; ``_add``)."""
        t = time.monotonic()
        if self.snapshots is None or self.stream is None:
            return
        got = self.snapshots.load()
        if got is None:
            return
        index, extra = got
        self.router.index = index
        for stream, cursor in extra["cursors"].items():
            self.stream.cursor[stream] = cursor
        for group, n in extra["next_n"].items():
            self.stream.next_n[group] = n
        groups = sorted(index.groups())  # (from the snapshot's header: no pass over the table)
        self.restored = {"keys": len(index), "groups": groups, "load_s": time.monotonic() - t}
        _log.warning("router replica restored %d index keys from %s in %.1f s", len(index), self.snapshots.path,
                     self.restored["load_s"])  # fmt: skip

    def _recover_groups(self, supervisor: str) -> None:
        """After Ray restarted this replica: ask the supervisor (the actor named ``supervisor``) for the serving
        groups, so routing resumes at once. If it does not answer, its health check hands them over later."""
        import ray

        try:
            handle: SupervisorHandle = ray.get_actor(supervisor)
            groups: dict[str, RankHandle] = ray.get(handle.serving_groups.remote(), timeout=GROUP_CALL_TIMEOUT_S / 3)
        except Exception as exc:
            _log.warning("router replica restarted; the supervisor did not list the groups (%s)", type(exc).__name__)
            return
        for group, leader in groups.items():
            self._add(group, leader)
        _log.warning("router replica restarted; serving groups %s again", ", ".join(sorted(groups)) or "none")

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        """Follow the groups' events. From Redis: a read that waits for new events (``STREAM_WAIT_MS``), then at
        least ``poll_interval_s`` before the next, so events arriving meanwhile come in one read; over Ray, a poll
        every ``poll_interval_s``."""
        delay = self.poll_interval_s
        while True:
            try:
                if self.stream is not None:
                    n = await self._poll_stream(STREAM_WAIT_MS)
                    delay = self.poll_interval_s if n else 0.0  # (an empty read has waited already)
                    if self.snapshots is not None and self.snapshots.due():
                        self.snapshot()
                else:
                    await self.poll()
                    delay = self.poll_interval_s
            except Exception as exc:  # Redis or a group briefly unreachable: keep the index, retry later
                delay = min(2.0, max(delay, self.poll_interval_s) * 2)
                _log.warning("event poll failed (%s: %s); retrying in %.2f s", type(exc).__name__, exc, delay)
            await asyncio.sleep(delay)

    async def poll(self) -> int:
        """Read every group's new events into this replica's index; returns how many. Also starts the
        background poller."""
        self._ensure_poller()
        if self.stream is not None:
            return await self._poll_stream()
        groups = list(self.leaders)
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(self.leaders[g].read_events.remote(self.offsets[g]), GROUP_CALL_TIMEOUT_S)
                for g in groups
            ),
            return_exceptions=True,
        )
        n = 0
        for g, reply in zip(groups, replies):
            if isinstance(reply, BaseException) or g not in self.leaders:
                continue  # a dead group: the supervisor removes or restarts it
            events, self.offsets[g] = reply
            self.router.apply_events([(g, e) for e in events])
            n += len(events)
        return n

    async def _poll_stream(self, block_ms: int | None = None) -> int:
        """Read the new events from Redis (``block_ms``: waiting that long for a first one; None: answer at
        once, what ``poll`` does) into the index; returns how many."""
        assert self.stream is not None
        # Only the Redis read runs in a thread: the index is this loop's alone, and routing goes on with the
        # index as it is while Redis is slow or down; the cursors resume where they were once it answers. Reads
        # may overlap (the poller's and a caller's ``poll``): a reply whose cursor moved meanwhile is dropped.
        streams = dict(self.stream.cursor)
        if not streams:
            if block_ms:  # no group yet: nothing to wait on in Redis
                await asyncio.sleep(block_ms / 1000)
            return 0
        reply = await asyncio.to_thread(self.stream.read, streams, block_ms)
        batch = self.stream.consume(streams, reply)
        self.router.apply_events([(group, event) for group, event in batch if group in self.leaders])
        for group in list(self.stream.needs_resync):
            leader = self.leaders.get(group)
            if leader is not None:  # an impossible offset asks for a snapshot
                events, _ = await asyncio.wait_for(leader.read_events.remote(-1), GROUP_CALL_TIMEOUT_S)
                self.router.apply_events([(group, event) for event in events])
            self.stream.needs_resync.discard(group)  # only once the snapshot is in
        return len(batch)

    async def route(
        self,
        tenant: str,
        token_ids: Sequence[int],
        request_id: str | None = None,
        exclude: Sequence[str] = (),
        cache_key: str | None = None,
        n: int = 1,
        adapter: str | None = None,
    ) -> RouteDecision:
        """A group for the request, with its leader's handle (groups come and go: callers keep no list);
        ``adapter``: the id of the LoRA adapter it runs under."""
        self._ensure_poller()
        decision = self.router.route(tenant, token_ids, request_id, exclude, cache_key, n, adapter)
        decision.leader = self.leaders[decision.group]
        return decision

    def report_failure(self, group: str, reason: str) -> None:
        """A caller saw ``group`` fail: route nothing more to it until the supervisor has restarted it."""
        if group in self.router.loads:
            self.router.pause_group(group)
            _log.warning("group %s paused after a failure (%s)", group, reason)

    def pause_group(self, group: str, paused: bool = True) -> None:
        """Stop (or resume) routing to ``group``; a group this replica does not know is ignored."""
        if group in self.router.loads:
            self.router.pause_group(group, paused)

    async def groups(self) -> dict[str, dict]:
        """Per group: whether it is paused, its load, and how many keys the index holds for it. (The supervisor
        asks every second; that also starts the event poller of a replica Ray has restarted.)"""
        self._ensure_poller()
        held = self.router.index.key_counts()
        return {
            g: {
                "paused": g in self.router.paused,
                "index_keys": held.get(g, 0),
                "queued_prefill_tokens": load.queued_prefill_tokens,
                "running": load.running,
            }
            for g, load in self.router.loads.items()
        }

    async def forget_tenant(self, tenant: str) -> dict[str, list[int]]:
        """Tell every group that ``tenant`` is deleted (``RankActor.forget_tenant``): per group, [pins released,
        blocks forgotten]; a group that does not answer is left out (its blocks age out). The removals reach
        every replica's index through the groups' events."""
        groups = list(self.leaders)
        replies = await asyncio.gather(
            *(asyncio.wait_for(self.leaders[g].forget_tenant.remote(tenant), GROUP_CALL_TIMEOUT_S) for g in groups),
            return_exceptions=True,
        )
        return {g: list(r) for g, r in zip(groups, replies) if not isinstance(r, BaseException)}

    def index_key_counts(self) -> dict[str, int]:
        """Keys the index holds per group, counted from the index itself (``"?"``: bits of no known group)."""
        return self.router.index.key_counts()

    def info(self) -> dict:
        """This replica's process id (it changes when Ray restarts the replica), its groups, what a snapshot
        restored at its start and its last snapshot written (None: none)."""
        last = self.snapshots.last if self.snapshots is not None else None
        return {"pid": os.getpid(), "groups": sorted(self.leaders), "restored": self.restored, "last_snapshot": last}

    def snapshot(self) -> asyncio.Task:
        """Write the index and its stream cursors to the snapshot file now (a task that ends once it is there)."""
        assert (
            self.snapshots is not None and self.stream is not None and isinstance(self.router.index, CompactPrefixIndex)
        )
        return self.snapshots.start(self.router.index, self.stream.cursor, self.stream.next_n)

    async def snapshot_now(self) -> dict | None:
        """``snapshot``, waited for: what ``info`` then says of it."""
        await self.snapshot()
        return self.snapshots.last if self.snapshots is not None else None

    def leaders_now(self) -> dict:
        return dict(self.leaders)

    def on_prefill_done(self, request_id: str) -> None:
        self.router.on_prefill_done(request_id)

    def report(self, events: Sequence[tuple[str, str | RouteNote]]) -> None:
        """A gateway's request events since its last report, in the order they happened: ``("note", RouteNote)``
        (``note_route``: another replica's route), ``("prefill_done", request_id)`` (``on_prefill_done``) and
        ``("finish", request_id)`` (``on_finish``); other kinds are ignored."""
        for kind, payload in events:
            if isinstance(payload, RouteNote):
                self.note_route(payload)
            elif kind == "prefill_done":
                self.on_prefill_done(payload)
            elif kind == "finish":
                self.on_finish(payload)

    def note_route(self, note: RouteNote) -> None:
        """Count a route another replica made (``Router.note_route``): its load, predictions and adapter."""
        self.router.note_route(note)

    def on_finish(self, request_id: str) -> None:
        self.router.on_finish(request_id)

    def cancel_route(self, request_id: str) -> None:
        """Forget a route that lost to another replica's (hedged routing): load, predictions, recent prefill."""
        self.router.cancel_route(request_id)

    def match(self, tenant: str, token_ids: Sequence[int]) -> dict[str, int]:
        """Leading blocks each group holds for this prompt (for inspection and tests)."""
        return self.router.match(self.router.keys_for(tenant, token_ids))

    def held(self, tenant: str, token_ids: Sequence[int]) -> dict[str, int]:
        """Like ``match``, but from the groups' events alone (no predictions): what this replica has learned
        from the streams, whichever replica routed the prompt."""
        return self.router.index.match(self.router.keys_for(tenant, token_ids))

    async def add_group(self, group: str, leader) -> None:
        """Route to ``group`` from now on; its index is read from the start of its events. Adding a group again
        with the same leader changes nothing; with another leader (a restart) it starts over."""
        self._ensure_poller()
        self._add(group, leader)

    def _add(self, group: str, leader) -> None:
        if group in self.leaders:
            if self.leaders[group] == leader:
                return
            self.remove_group(group)
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


def restarted() -> bool:
    """Whether Ray restarted the current actor after a crash (False outside an actor)."""
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_actor_id() is not None and ctx.was_current_actor_reconstructed
