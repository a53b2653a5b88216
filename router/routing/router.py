"""The router: hash a request's leading blocks with its tenant's root key, find which groups hold them, pick
one with the policy, and keep per-group load. Exact, because the workers publish the same keys."""

from __future__ import annotations

import hashlib
import itertools
import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.errors import NoGroup, Overloaded
from common.events import BlockStored, KVEvent
from common.hashing import ChunkKeyCache, RootKeys, block_keys, iter_key_chunks
from router.routing.adapters import AdapterResidency
from router.routing.index import PrefixIndex, TierMatch, clear_bit, new_index
from router.routing.policy import GroupLoad, RouteRequest, RoutingPolicy, make_policy
from router.routing.transport import Subscription

# A prompt_cache_key's group whose queued prefill is this far above the least queued group's is overloaded: the
# request goes where the policy sends it (about a second of prefill on a CPU group).
CACHE_KEY_OVERLOAD_TOKENS = 16384
# Request ids that ended lately, kept so that another replica's route told after the request's end is not counted
# (Ray may run a gateway's calls to a replica out of order): the last this many.
ENDED_IDS_KEPT = 16384


@dataclass
class RouteNote:
    """A route as the other router replicas count it (``Router.note_route``): what the routing replica put in its
    group's queue and predicted there."""

    request_id: str
    group: str
    prefill_tokens: int  # what it adds to its group's queue (``_Inflight.prefill_tokens``)
    keys: list[bytes]  # the prompt's first ``prediction_blocks`` block keys (none when predictions are off)
    tenant: str = ""
    adapter: str | None = None
    choices: int = 1


@dataclass
class RouteDecision:
    request_id: str
    group: str
    cached_tokens: int  # prompt tokens the chosen group holds in any tier (index + predictions)
    leader: Any = None  # the group's rank-0 actor, filled in by the router service
    host_tokens: int = 0  # of cached_tokens, those the group holds in host RAM (not in its GPU pool)
    disk_tokens: int = 0  # ... on disk only
    note: RouteNote | None = None  # what the other replicas are told of this route (the gateway passes it on)


@dataclass
class _Inflight:
    group: str
    prefill_tokens: int  # what it adds to its group's queue: tokens to compute, plus its lower-tier loads (weighted)
    tenant: str = ""
    decoding: bool = False
    routed_at: float = 0.0
    choices: int = 1  # n: the sequences it decodes once prefilled (its prompt is computed once)
    # What its route predicted (for ``cancel_route``): each key with the expiry it had for this group before,
    # None where it was not predicted there, and the expiry this route gave them all.
    predicted: list[tuple[bytes, float | None]] = field(default_factory=list)
    predicted_until: float = 0.0


class Router:
    """One replica's routing state. Not thread-safe: one event loop or thread drives it."""

    def __init__(
        self,
        groups: Sequence[str],
        secret: bytes | str,
        block_size: int = 16,
        policy: RoutingPolicy | str = "kvgrid",
        hash_algo: str = "xxh3_128",
        prediction_ttl_s: float = 10.0,
        prediction_blocks: int | None = 128,
        recent_window_s: float = 60.0,
        max_queued_prefill_tokens: int | None = None,
        tenant_shares: dict[str, float] | None = None,
        events: Subscription | None = None,
        clock: Callable[[], float] = time.monotonic,
        cache_key_overload_tokens: int = CACHE_KEY_OVERLOAD_TOKENS,
        index: str = "compact",
    ) -> None:
        self.block_size = block_size
        self.cache_key_overload_tokens = cache_key_overload_tokens
        self.hash_algo = hash_algo
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.index: PrefixIndex = new_index(index)  # "dict" or "compact" (router/routing/index.py)
        self.loads: dict[str, GroupLoad] = {}
        self.prediction_ttl_s = prediction_ttl_s
        self.prediction_blocks = prediction_blocks
        self.recent_window_s = recent_window_s
        self.max_queued_prefill_tokens = max_queued_prefill_tokens
        self.tenant_shares = dict(tenant_shares or {})
        self.queued_by_tenant: dict[str, int] = {}
        self._decayed_at = clock()
        self.events = events
        self.clock = clock
        self.root_key = RootKeys(secret, hash_algo)  # (tenant, adapter) -> its root key
        self.adapters = AdapterResidency()  # the LoRA adapters each group ran lately
        self._chunk_cache = ChunkKeyCache()
        self._predicted: dict[bytes, int] = {}  # key -> bits of groups predicted to hold it
        self._predicted_until: dict[tuple[bytes, int], float] = {}  # (key, bit) -> when it lapses
        self._expiry: deque[tuple[float, int, list[bytes]]] = deque()
        self._inflight: dict[str, _Inflight] = {}
        self._ended: dict[
            str, None
        ] = {}  # the last ENDED_IDS_KEPT request ids that ended (``on_finish``), oldest first
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)  # ids stay unique across router replicas
        self.paused: set[str] = set()  # known groups that get no new requests (draining, or suspected dead)
        for g in groups:
            self.add_group(g)

    # -- groups and events ------------------------------------------------------------------------------------

    def add_group(self, group: str) -> None:
        self.index.bit(group)
        self.loads.setdefault(group, GroupLoad())
        self.paused.discard(group)

    def pause_group(self, group: str, paused: bool = True) -> None:
        """Stop (or resume) routing new requests to ``group``; its index entries and in-flight requests stay."""
        if group not in self.loads:
            raise KeyError(f"unknown worker group {group!r}")
        if paused:
            self.paused.add(group)
        else:
            self.paused.discard(group)

    def remove_group(self, group: str) -> None:
        """Stop routing to ``group`` and drop its index entries and predictions at once."""
        bit = self.index.bit(group)
        self.index.remove_group(group)
        self.loads.pop(group, None)
        self.paused.discard(group)
        self.adapters.drop_group(group)
        for key in [k for k, m in self._predicted.items() if m & bit]:
            self._unpredict(key, bit)
        # Its requests must not touch the load of a new group that reuses the name.
        for rid in [r for r, f in self._inflight.items() if f.group == group]:
            f = self._inflight.pop(rid)
            if not f.decoding:
                self._unqueue(f)

    def apply_event(self, group: str, event: KVEvent) -> None:
        if group not in self.loads:
            return  # a removed group's late events
        self.index.apply(group, event)
        if isinstance(event, BlockStored) and self._predicted:
            self._confirm(group, event.keys)

    def apply_events(self, batch: Sequence[tuple[str, KVEvent]]) -> None:
        """``apply_event`` for a batch of ``(group, event)``, put into the index together (fewer, larger table
        operations: ``PrefixIndex.apply_many``)."""
        batch = [(g, e) for g, e in batch if g in self.loads]
        self.index.apply_many(batch)
        if self._predicted:
            for group, event in batch:
                if isinstance(event, BlockStored):
                    self._confirm(group, event.keys)

    def _confirm(self, group: str, keys: list[bytes]) -> None:
        """Stored keys that were predicted for ``group``: the prediction has become a fact."""
        bit = self.index.bit(group)
        for k in self._predicted.keys() & keys:
            if self._predicted[k] & bit:
                self._unpredict(k, bit)

    def poll_events(self) -> int:
        """Apply what the transport has delivered; returns how many events."""
        if self.events is None:
            return 0
        batch = self.events.poll()
        self.apply_events(batch)
        return len(batch)

    # -- routing ----------------------------------------------------------------------------------------------

    def keys_for(self, tenant: str, token_ids: Sequence[int], adapter: str | None = None) -> list[bytes]:
        """The same keys the workers compute for this tenant's prompt (under LoRA adapter id ``adapter``)."""
        return block_keys(token_ids, self.block_size, self.root_key(tenant, adapter), self.hash_algo)

    def match(self, keys: list[bytes]) -> dict[str, int]:
        """Leading blocks each group holds (in any tier), counting unexpired predictions."""
        return {g: t.blocks for g, t in self.match_tiers(keys).items()}

    def match_tiers(self, keys: list[bytes]) -> dict[str, TierMatch]:
        """``match`` with each group's run split by tier (predicted blocks count as GPU)."""
        return self._match_chunks([keys])

    def _match_chunks(self, chunks) -> dict[str, TierMatch]:
        self._expire()
        return self.index.match_tiers(chunks, self._predicted)

    def route(
        self,
        tenant: str,
        token_ids: Sequence[int],
        request_id: str | None = None,
        exclude: Collection[str] = (),
        cache_key: str | None = None,
        n: int = 1,
        adapter: str | None = None,
    ) -> RouteDecision:
        """Pick a group for this tenant's prompt (never a paused one, nor one in ``exclude``). Keys are hashed
        lazily: a prompt whose leading blocks no group holds costs a few hashes, not one per block. A
        ``cache_key`` (OpenAI's ``prompt_cache_key``) sends the request to its key's group whatever its blocks,
        unless that group is overloaded (``key_group``). ``n``: the request's choices, which prefill once and
        then count as ``n`` running requests. ``adapter``: the id of the LoRA adapter it runs under, whose blocks
        are its own (their keys descend from the tenant's and the adapter's root); a group that ran it lately
        holds it already and is charged no ``adapter_load_tokens`` for loading it."""
        self.poll_events()
        root = self.root_key(tenant, adapter)
        lazy = iter_key_chunks(token_ids, self.block_size, root, self.hash_algo, cache=self._chunk_cache)
        return self._route(_Tee(lazy), len(token_ids), request_id, exclude, tenant, cache_key, adapter, n)

    def route_keys(self, keys: list[bytes], num_tokens: int, request_id: str | None = None) -> RouteDecision:
        """Route a prompt given its block keys (what ``route`` does after hashing)."""
        return self._route(_Tee(iter([keys])), num_tokens, request_id, (), "")

    def _route(
        self,
        keys: _Tee,
        num_tokens: int,
        request_id: str | None,
        exclude: Collection[str],
        tenant: str,
        cache_key: str | None = None,
        adapter: str | None = None,
        n: int = 1,
    ) -> RouteDecision:
        open_groups = {g: load for g, load in self.loads.items() if g not in self.paused and g not in exclude}
        if not open_groups:
            raise NoGroup(
                "no worker group is serving"
                if not self.loads
                else f"no worker group is accepting requests (paused or failed: {sorted(self.loads)})"
            )
        tiers = self._match_chunks(keys)
        cached = {g: t.blocks for g, t in tiers.items()}
        self._decay_recent()
        if self.policy.needs_all_keys:
            keys.take(None)
        req = RouteRequest(keys.seen, num_tokens, self.block_size, cached, tiers)
        if adapter is not None:
            req.extra_tokens = self.adapters.load_tokens(adapter, open_groups)
        if self.max_queued_prefill_tokens is not None:
            limit = self.max_queued_prefill_tokens
            with_room = {g: load for g, load in open_groups.items() if load.queued_prefill_tokens < limit}
            if with_room:
                open_groups = with_room
            else:  # every queue is full: refuse only a tenant that has its share of them queued already
                share = self.queue_share(tenant)
                if self.queued_by_tenant.get(tenant, 0) >= share:
                    raise Overloaded(
                        f"every worker group has {limit} or more prefill tokens queued and this "
                        f"tenant has its share ({share}) of them"
                    )
        group = self.key_group(tenant, cache_key, open_groups) if cache_key is not None else None
        if group is None:
            group = self.policy.choose(req, open_groups)
        gpu, host, disk = req.tier_tokens(group)
        hit = gpu + host + disk
        rid = request_id if request_id is not None else f"route-{self._id_prefix}-{next(self._ids)}"
        # Its queued work: the tokens no tier holds, plus the time loading the lower-tier ones takes there.
        prefill = num_tokens - hit + self.policy.load_tokens(host, disk)
        f = self._start(rid, group, prefill, tenant, n)
        if adapter is not None:
            self.adapters.used(group, adapter)
        leading = keys.take(self.prediction_blocks) if self.prediction_ttl_s > 0 else []
        f.predicted, f.predicted_until = self._predict(leading, group)
        note = RouteNote(rid, group, prefill, leading, tenant, adapter, n)
        return RouteDecision(rid, group, hit, host_tokens=host, disk_tokens=disk, note=note)

    def note_route(self, note: RouteNote) -> None:
        """Count a route another replica made as if it were made here (router replicas share their routes so
        that each prices the groups on the whole fleet's load): its prefill queued on its group, so that
        ``on_prefill_done``, ``on_finish`` and ``cancel_route`` apply to it; its leading blocks predicted there;
        its adapter used there. Ignored: a group this replica does not know, a request it counts already or that
        ended lately (its end came first: calls may run out of order). A paused group's is counted: its in-flight
        requests still load it."""
        rid = note.request_id
        if rid in self._inflight or rid in self._ended or note.group not in self.loads:
            return
        self._decay_recent()  # (the recent prefill it adds counts from now)
        f = self._start(rid, note.group, note.prefill_tokens, note.tenant, note.choices)
        if note.adapter is not None:
            self.adapters.used(note.group, note.adapter)
        f.predicted, f.predicted_until = self._predict(note.keys, note.group)

    def key_group(self, tenant: str, cache_key: str, groups: dict[str, GroupLoad]) -> str | None:
        """The group of ``groups`` that a tenant's ``cache_key`` maps to, or None when that group is overloaded
        (its queued prefill more than ``cache_key_overload_tokens`` above the least queued group's; the policy
        then chooses). The map is rendezvous hashing of (tenant, key) over the groups: the same in every router
        replica and after restarts without any shared state, different keys spread evenly over the groups, and
        a group that joins or leaves moves only the keys that map to it."""

        def weight(group: str) -> bytes:
            return hashlib.blake2b(
                f"{tenant}\0{cache_key}\0{group}".encode("utf-8", "surrogatepass"), digest_size=8
            ).digest()

        group = max(groups, key=weight)
        least = min(load.queued_prefill_tokens for load in groups.values())
        if groups[group].queued_prefill_tokens > least + self.cache_key_overload_tokens:
            return None
        return group

    # -- load bookkeeping -------------------------------------------------------------------------------------

    def queue_share(self, tenant: str) -> int:
        """Prefill tokens ``tenant`` may have queued once every group's queue is full: its weighted part of all
        queues (all of them when no shares are configured)."""
        total = (self.max_queued_prefill_tokens or 0) * sum(1 for g in self.loads if g not in self.paused)
        if not self.tenant_shares:
            return total
        return int(total * self.tenant_shares.get(tenant, 1.0) / sum(self.tenant_shares.values()))

    def _start(self, rid: str, group: str, prefill_tokens: int, tenant: str = "", choices: int = 1) -> _Inflight:
        if rid in self._inflight:  # a hedge's loser routing it after the winner's note: never counted twice
            self.cancel_route(rid)
        f = self._inflight[rid] = _Inflight(group, prefill_tokens, tenant, routed_at=self.clock(), choices=choices)
        self.queued_by_tenant[tenant] = self.queued_by_tenant.get(tenant, 0) + prefill_tokens
        self.loads[group].queued_prefill_tokens += prefill_tokens
        self.loads[group].recent_prefill_tokens += prefill_tokens
        return f

    def _decay_recent(self) -> None:
        now = self.clock()
        factor = math.exp(-(now - self._decayed_at) / self.recent_window_s)
        self._decayed_at = now
        for load in self.loads.values():
            load.recent_prefill_tokens *= factor

    def on_prefill_done(self, request_id: str) -> None:
        """The request's first token is out: its prefill leaves the queue, it now decodes."""
        f = self._inflight.get(request_id)
        if f is None or f.decoding:
            return
        f.decoding = True
        self._unqueue(f)
        load = self.loads.get(f.group)
        if load is not None:
            load.queued_prefill_tokens -= f.prefill_tokens
            load.running += f.choices

    def on_finish(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed)."""
        self._finish(request_id)
        self._ended[request_id] = None
        if len(self._ended) > ENDED_IDS_KEPT:
            del self._ended[next(iter(self._ended))]

    def cancel_route(self, request_id: str) -> None:
        """Undo the route of a request that will not run on it (another replica's route won): it leaves the
        load, and neither its predictions nor its prefill stay counted for its group. Unknown ids are ignored."""
        f = self._finish(request_id)
        if f is None or f.group not in self.loads:
            return
        bit, now = self.index.bit(f.group), self.clock()
        for key, before in f.predicted:
            if self._predicted_until.get((key, bit)) != f.predicted_until:
                continue  # confirmed by an event, or predicted again since by another route: that one stands
            if before is None or before <= now:
                self._unpredict(key, bit)
            else:  # it renewed an earlier route's prediction: that one lapses when it would have (its expiry
                self._predicted_until[(key, bit)] = before  # entry is still queued: it lies in the future)
        self._decay_recent()
        load = self.loads[f.group]
        added = f.prefill_tokens * math.exp(-(now - f.routed_at) / self.recent_window_s)
        load.recent_prefill_tokens = max(0.0, load.recent_prefill_tokens - added)

    def _finish(self, request_id: str) -> _Inflight | None:
        f = self._inflight.pop(request_id, None)
        if f is None:
            return None
        if not f.decoding:
            self._unqueue(f)
        load = self.loads.get(f.group)
        if load is None:
            return f
        if f.decoding:
            load.running -= f.choices
        else:
            load.queued_prefill_tokens -= f.prefill_tokens
        return f

    def _unqueue(self, f: _Inflight) -> None:
        left = self.queued_by_tenant.get(f.tenant, 0) - f.prefill_tokens
        if left > 0:
            self.queued_by_tenant[f.tenant] = left
        else:
            self.queued_by_tenant.pop(f.tenant, None)

    # -- predictions ------------------------------------------------------------------------------------------

    def _predict(self, keys: list[bytes], group: str) -> tuple[list[tuple[bytes, float | None]], float]:
        """Count ``keys`` as held by ``group`` until its events confirm them or ``prediction_ttl_s`` passes.
        Returns the keys predicted, each with the expiry it had before (None: not predicted there), and the new
        expiry."""
        if not keys or self.prediction_ttl_s <= 0:
            return [], 0.0
        bit = self.index.bit(group)
        until = self.clock() + self.prediction_ttl_s
        predicted, pred_until = self._predicted, self._predicted_until
        fresh = [k for k, held in zip(keys, self.index.holders_many(keys)) if not held & bit]
        made = []
        for k in fresh:
            predicted[k] = predicted.get(k, 0) | bit
            made.append((k, pred_until.get((k, bit))))
            pred_until[(k, bit)] = until
        if fresh:
            self._expiry.append((until, bit, fresh))
        return made, until

    def _expire(self) -> None:
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, bit, keys = self._expiry.popleft()
            for k in keys:
                if self._predicted_until.get((k, bit), now + 1) <= now:  # not renewed since
                    self._unpredict(k, bit)

    def _unpredict(self, key: bytes, bit: int) -> None:
        clear_bit(self._predicted, key, bit)
        self._predicted_until.pop((key, bit), None)


class _Tee:
    """Iterates lazily computed key chunks and remembers the keys already produced."""

    def __init__(self, chunks: Iterator[Sequence[bytes]]) -> None:
        self.chunks = chunks
        self.seen: list[bytes] = []

    def __iter__(self) -> Iterator[Sequence[bytes]]:
        for chunk in self.chunks:
            self.seen.extend(chunk)
            yield chunk

    def take(self, n: int | None) -> list[bytes]:
        """The first ``n`` keys (all if ``n`` is None; fewer if the prompt has fewer), computing any not
        produced yet."""
        while n is None or len(self.seen) < n:
            chunk = next(self.chunks, None)
            if chunk is None:
                break
            self.seen.extend(chunk)
        return self.seen if n is None else self.seen[:n]
