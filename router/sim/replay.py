"""``kvgrid replay``: a request trace through the real router and simulated worker groups.

Trace format (the Mooncake traces; a cut ships in ``tests/data``): one JSON object per line with ``timestamp``
(ms), ``input_length``, ``output_length`` and ``hash_ids``, one id per block of the prompt, chained (equal ids
mean equal content and equal prefix). A request's block keys are the chained hash (``common.hashing``) of its
ids under its tenant's root key: the same index, policy and load bookkeeping a live router runs, fed with ids
instead of tokens.

Each simulated group has a real ``BlockPool`` of ``capacity_tokens // block_size`` blocks (reference counts,
LRU eviction) and publishes its real KV events to the router. Time model: requests arrive at their
timestamps; a group prefills one request at a time at ``prefill_tokens_per_s`` over the tokens it does not
hold; when the prefill ends the first token is out (TTFT), the blocks are registered, and the request decodes
``output_length`` tokens at ``decode_s_per_token`` alongside others, holding its blocks until it finishes.

Tiers (``--host-capacity-tokens N``, ``--disk-capacity-tokens N``, per group; both 0 by default): under its GPU
pool a group keeps a host-RAM tier and a disk tier, each an LRU of block keys (``SimTier``). A block the GPU
pool evicts is written back to host RAM, and a block host RAM evicts goes to disk (inclusive: a block already in
the tier below is not written again, only moved to its most recent end); each tier publishes ``BlockStored`` /
``BlockRemoved`` with its ``tier`` to the router, like a real group. A request's hit is the leading run of its
blocks that any tier holds: GPU blocks are attached, host and disk blocks are loaded into fresh GPU blocks at
``--host-load-rate`` / ``--disk-load-rate`` tokens/s, and the load time is added to the prefill's (so it is
charged in the queue and the TTFT); loaded tokens count as hits.

Tenants: ``--tenants T`` puts a request in tenant ``hash_ids[1] % T`` (``hash_ids[0]`` when the prompt has one
block), so every turn of a conversation stays in one tenant; the default is one tenant.

Hit ratio (as in the trace's README): the sum over requests of ``min(leading cached blocks x block_size,
input_length)`` divided by the total input tokens. References on the same trace and keys: one pooled LRU cache
with the capacity of all groups together, and an infinite cache, both in file order without timing.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from common.events import BlockRemoved, BlockStored, KVEvent, Tier
from common.hashing import RootKeys, block_keys
from router.routing.policy import (
    DEFAULT_DISK_LOAD_TOKENS_PER_S,
    DEFAULT_HOST_LOAD_TOKENS_PER_S,
    POLICIES,
    CacheAwarePolicy,
    load_weight,
    make_policy,
)
from router.routing.router import Router
from router.routing.transport import InProcessTransport
from router.sim.trace import TraceEntry, read_mooncake
from worker.block_pool import Block, BlockPool

REPLAY_SECRET = b"kvgrid-replay"


@dataclass
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    keys: list[bytes]


def load_trace(path: str | Path, tenants: int = 1, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a trace (``router.sim.trace.read_mooncake``), with their block keys."""
    return trace_requests(read_mooncake(path, limit), tenants)


def trace_requests(entries: Iterable[TraceEntry], tenants: int = 1) -> list[TraceRequest]:
    """Trace records with their block keys (a request's tenant as ``load_trace`` says)."""
    if tenants < 1:
        raise ValueError("tenants must be >= 1")
    root_key = RootKeys(REPLAY_SECRET)
    out = []
    for e in entries:
        ids = list(e.hash_ids)
        tenant = (ids[1] if len(ids) > 1 else ids[0]) % tenants if ids else 0
        keys = block_keys(ids, 1, root_key(f"tenant-{tenant}"))
        out.append(TraceRequest(e.timestamp_s, e.input_length, e.output_length, keys))
    return out


@dataclass
class _Running:
    req: TraceRequest
    rid: str
    blocks: list[Block] = field(default_factory=list)  # every GPU block it holds (freed when it finishes)
    fill: list[tuple[int, Block]] = field(default_factory=list)  # (position, fresh block) to register
    hit_tokens: int = 0
    host_tokens: int = 0  # of hit_tokens, those loaded from host RAM
    disk_tokens: int = 0  # ... from disk


class SimTier:
    """A lower tier of a simulated group: an LRU of block keys with room for ``capacity_blocks``, publishing its
    ``BlockStored`` / ``BlockRemoved`` events (with its ``tier``)."""

    def __init__(self, tier: Tier, capacity_blocks: int, publish: Callable[[KVEvent], None]) -> None:
        self.tier, self.capacity, self.publish = tier, capacity_blocks, publish
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.written = 0  # blocks written into this tier

    def __contains__(self, key: bytes) -> bool:
        return key in self.keys

    def touch(self, keys: list[bytes]) -> None:
        """Mark held ``keys`` as just used."""
        for k in keys:
            if k in self.keys:
                self.keys.move_to_end(k)

    def put(self, keys: list[bytes]) -> list[bytes]:
        """Write the ``keys`` this tier lacks (those it holds are only marked used); returns the keys it evicted to
        make room, least recently used first."""
        new = []
        for k in keys:
            if k in self.keys:
                self.keys.move_to_end(k)
            else:
                self.keys[k] = None
                new.append(k)
        if not new:
            return []
        self.written += len(new)
        self.publish(BlockStored(new, None, self.tier))
        evicted = [self.keys.popitem(last=False)[0] for _ in range(len(self.keys) - self.capacity)]
        if evicted:
            self.publish(BlockRemoved(evicted, self.tier))
        return evicted


class SimGroup:
    def __init__(
        self,
        name: str,
        num_blocks: int,
        block_size: int,
        transport: InProcessTransport,
        host_blocks: int = 0,
        disk_blocks: int = 0,
    ) -> None:
        self.name = name
        self.block_size = block_size
        self.sink = _GroupSink(name, transport, self.write_back)
        self.pool = BlockPool(num_blocks, self.sink)
        self.host = SimTier(Tier.HOST, host_blocks, self.sink.publish) if host_blocks > 0 else None
        self.disk = SimTier(Tier.DISK, disk_blocks, self.sink.publish) if disk_blocks > 0 else None
        self._below = [t for t in (self.host, self.disk) if t is not None]  # where an eviction is written, in order
        self.queue: deque[_Running] = deque()
        self.busy = False
        self.prefill_tokens = 0
        self.host_tokens = 0  # tokens loaded from host RAM
        self.disk_tokens = 0  # ... from disk
        self.uncacheable_tokens = 0

    def write_back(self, keys: list[bytes], level: int = 0) -> None:
        """Blocks evicted from the GPU pool (``level`` 0) or from the tier ``level`` below it go one tier down."""
        if level < len(self._below):
            evicted = self._below[level].put(keys)
            if evicted:
                self.write_back(evicted, level + 1)

    def _tier_of(self, key: bytes) -> Block | Tier | None:
        b = self.pool.lookup(key)
        if b is not None:
            return b
        if self.host is not None and key in self.host:
            return Tier.HOST
        if self.disk is not None and key in self.disk:
            return Tier.DISK
        return None

    def start_prefill(self, r: _Running) -> int:
        """Attach the cached GPU blocks of the prompt's leading run, allocate the rest (the run's lower-tier
        blocks are loaded into some of them); returns the tokens to compute."""
        keys, bs, length = r.req.keys, self.block_size, r.req.input_length
        run: list[Block | Tier] = []
        for key in keys:
            where = self._tier_of(key)
            if where is None:
                break
            run.append(where)
        gpu = [x for x in run if isinstance(x, Block)]
        self.pool.touch(gpu)
        for tier in self._below:  # before allocating: the write-back of what it evicts must not push these out
            tier.touch([k for k, x in zip(keys, run) if x is tier.tier])
        fresh = iter(self.pool.allocate(min(len(keys) - len(gpu), self.pool.num_free)))
        hit = len(run)
        loaded = {Tier.HOST: 0, Tier.DISK: 0}
        r.blocks, r.fill = [], []
        for i in range(len(keys)):
            x = run[i] if i < len(run) else None
            if isinstance(x, Block):
                r.blocks.append(x)
                continue
            b = next(fresh, None)
            if b is None:  # no GPU block left for it: neither loaded nor cached
                hit = min(hit, i)
                self.uncacheable_tokens += min(bs, length - i * bs)
                continue
            r.blocks.append(b)
            r.fill.append((i, b))
            if x is not None and i < hit:
                loaded[x] += min(bs, length - i * bs)
        r.hit_tokens = min(hit * bs, length)
        r.host_tokens, r.disk_tokens = loaded[Tier.HOST], loaded[Tier.DISK]
        self.host_tokens += r.host_tokens
        self.disk_tokens += r.disk_tokens
        compute = length - r.hit_tokens
        self.prefill_tokens += compute
        return compute

    def end_prefill(self, r: _Running) -> None:
        """Register the loaded and computed full blocks (the trace's last block may be partial)."""
        keys, full = r.req.keys, r.req.input_length // self.block_size
        fill = [(i, b) for i, b in r.fill if i < full]
        start = 0
        for j in range(1, len(fill) + 1):  # one ``cache`` call per run of consecutive positions
            if j == len(fill) or fill[j][0] != fill[j - 1][0] + 1:
                first = fill[start][0]
                seg = fill[start:j]
                self.pool.cache([b for _, b in seg], keys[first : first + len(seg)], keys[first - 1] if first else None)
                start = j
        r.fill = []

    def finish(self, r: _Running) -> None:
        self.pool.free(reversed(r.blocks))


class _GroupSink:
    """Publishes a group's events to the router; a GPU eviction is also written back to the group's lower tiers."""

    def __init__(self, name: str, transport: InProcessTransport, on_evict: Callable[[list[bytes]], None]) -> None:
        self.name, self.transport, self.on_evict = name, transport, on_evict

    def publish(self, event) -> None:
        self.transport.publish(self.name, [event])
        if isinstance(event, BlockRemoved) and event.tier is Tier.GPU:
            self.on_evict(event.keys)


def reference_hit_ratios(trace: list[TraceRequest], capacity_tokens: int, block_size: int) -> tuple[float, float]:
    """(pooled LRU of ``capacity_tokens``, infinite cache) token hit ratios, in file order."""
    pool = BlockPool(max(1, capacity_tokens // block_size))
    seen: set[bytes] = set()  # the infinite cache, also of full blocks only
    lru_hit = inf_hit = total = 0
    for r in trace:
        total += r.input_length
        n = 0
        for k in r.keys:
            if k not in seen:
                break
            n += 1
        inf_hit += min(n * block_size, r.input_length)
        seen.update(r.keys[: r.input_length // block_size])
        hits = pool.cached_prefix(r.keys)
        lru_hit += min(len(hits) * block_size, r.input_length)
        pool.touch(hits)
        # Like the simulated groups, cache full blocks only (a trailing partial block is computed, not kept).
        full = r.input_length // block_size
        fresh = pool.allocate(min(max(0, full - len(hits)), pool.num_free))
        pool.cache(fresh, r.keys[len(hits) : len(hits) + len(fresh)], r.keys[len(hits) - 1] if hits else None)
        pool.free(reversed(hits + fresh))
    return lru_hit / total, inf_hit / total


def replay(
    trace: list[TraceRequest],
    groups: int,
    capacity_tokens: int,
    block_size: int,
    policy: str = "kvgrid",
    prefill_tokens_per_s: float = 16000.0,
    decode_s_per_token: float = 0.02,
    seed: int = 0,
    progress: bool = True,
    host_capacity_tokens: int = 0,
    disk_capacity_tokens: int = 0,
    host_load_tokens_per_s: float = DEFAULT_HOST_LOAD_TOKENS_PER_S,
    disk_load_tokens_per_s: float = DEFAULT_DISK_LOAD_TOKENS_PER_S,
    index: str = "compact",
) -> dict:
    """Run ``trace`` through the router (its prefix index of kind ``index``) and ``groups`` simulated groups (each
    with ``capacity_tokens`` in its GPU pool, and the given host-RAM and disk tiers under it); returns the figures
    of the run."""
    if groups < 1 or capacity_tokens < block_size or block_size < 1:
        raise ValueError("need groups >= 1 and capacity_tokens >= block_size >= 1")
    if host_capacity_tokens < 0 or disk_capacity_tokens < 0:
        raise ValueError("host and disk capacities must be >= 0 tokens")
    if min(prefill_tokens_per_s, host_load_tokens_per_s, disk_load_tokens_per_s) <= 0:
        raise ValueError("prefill and load rates must be > 0 tokens/s")
    tiers = _Tiers(
        host_capacity_tokens // block_size,
        disk_capacity_tokens // block_size,
        host_load_tokens_per_s,
        disk_load_tokens_per_s,
    )
    sim = _Simulation(
        groups, capacity_tokens, block_size, policy, prefill_tokens_per_s, decode_s_per_token, seed, tiers, index
    )
    bar = _progress(len(trace), progress)
    sim.run(trace, bar.update)
    bar.close()

    total = sum(r.input_length for r in trace)
    computed = [g.prefill_tokens for g in sim.groups.values()]
    host = sum(g.host_tokens for g in sim.groups.values())
    disk = sum(g.disk_tokens for g in sim.groups.values())
    lru, inf = reference_hit_ratios(trace, capacity_tokens * groups, block_size)
    ttfts = sorted(sim.ttfts)
    return {
        "policy": policy,
        "groups": groups,
        "capacity_tokens_per_group": capacity_tokens,
        "host_capacity_tokens_per_group": host_capacity_tokens,
        "disk_capacity_tokens_per_group": disk_capacity_tokens,
        "block_size": block_size,
        "requests": len(trace),
        "hit_ratio": 1 - sum(computed) / total,
        # Where the hits came from, as parts of all input tokens (they add up to hit_ratio).
        "hit_ratio_by_tier": {
            "gpu": 1 - (sum(computed) + host + disk) / total,
            "host": host / total,
            "disk": disk / total,
        },
        "load_s": host / host_load_tokens_per_s + disk / disk_load_tokens_per_s,  # over all groups
        "imbalance": max(computed) / statistics.mean(computed) if sum(computed) else 1.0,
        "ttft_p50_s": _pct(ttfts, 0.50),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "pooled_lru_hit_ratio": lru,
        "infinite_hit_ratio": inf,
        "prefill_tokens_per_group": dict(zip(sim.groups, computed)),
    }


class _Event(enum.Enum):
    ARRIVE = enum.auto()  # a request reaches the router
    PREFILL_DONE = enum.auto()  # its group has computed its prompt: the first token is out
    FINISH = enum.auto()  # its last output token is out


@dataclass
class _Tiers:
    """The lower tiers of every simulated group: sizes in blocks (0: none) and load rates in tokens/s."""

    host_blocks: int = 0
    disk_blocks: int = 0
    host_load_tokens_per_s: float = DEFAULT_HOST_LOAD_TOKENS_PER_S
    disk_load_tokens_per_s: float = DEFAULT_DISK_LOAD_TOKENS_PER_S


class _Simulation:
    """The discrete-event loop of one replay: the router on a simulated clock, the groups, and a heap of
    ``(time, order, event, payload)`` (the order number keeps equal times first come, first served)."""

    def __init__(
        self,
        groups: int,
        capacity_tokens: int,
        block_size: int,
        policy: str,
        prefill_tokens_per_s: float,
        decode_s_per_token: float,
        seed: int,
        tiers: _Tiers | None = None,
        index: str = "compact",
    ) -> None:
        transport = InProcessTransport()
        names = [f"g{i}" for i in range(groups)]
        self.now = 0.0
        self.tiers = tiers = tiers or _Tiers()
        weights = {}
        if issubclass(POLICIES.get(policy, object), CacheAwarePolicy):  # loads cost what they cost this simulation
            weights = {
                "host_load_weight": load_weight(tiers.host_load_tokens_per_s, prefill_tokens_per_s),
                "disk_load_weight": load_weight(tiers.disk_load_tokens_per_s, prefill_tokens_per_s),
            }
        self.router = Router(
            names,
            REPLAY_SECRET,
            block_size,
            make_policy(policy, seed=seed, **weights),
            prediction_ttl_s=60.0,
            events=transport.subscribe(),
            clock=lambda: self.now,
            index=index,
        )
        self.groups = {
            n: SimGroup(n, capacity_tokens // block_size, block_size, transport, tiers.host_blocks, tiers.disk_blocks)
            for n in names
        }
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_s_per_token = decode_s_per_token
        self.ttfts: list[float] = []
        self._heap: list = []
        self._order = itertools.count()

    def run(self, trace: list[TraceRequest], on_arrival: Callable[[int], object]) -> None:
        for i, r in enumerate(trace):
            self._push(r.arrival_s, _Event.ARRIVE, (i, r))
        while self._heap:
            self.now, _, event, payload = heapq.heappop(self._heap)
            if event is _Event.ARRIVE:
                self._arrive(*payload)
                on_arrival(1)
            elif event is _Event.PREFILL_DONE:
                self._prefill_done(*payload)
            else:
                g, run = payload
                g.finish(run)
                self.router.on_finish(run.rid)

    def _push(self, t: float, event: _Event, payload) -> None:
        heapq.heappush(self._heap, (t, next(self._order), event, payload))

    def _arrive(self, i: int, r: TraceRequest) -> None:
        self.router.poll_events()
        d = self.router.route_keys(r.keys, r.input_length, f"r{i}")
        g = self.groups[d.group]
        g.queue.append(_Running(r, d.request_id))
        self._start_next(g)

    def _prefill_done(self, g: SimGroup, run: _Running) -> None:
        g.end_prefill(run)
        self.router.on_prefill_done(run.rid)
        self.ttfts.append(self.now - run.req.arrival_s)
        g.busy = False
        self._push(self.now + run.req.output_length * self.decode_s_per_token, _Event.FINISH, (g, run))
        self._start_next(g)

    def _start_next(self, g: SimGroup) -> None:
        """Start the group's next queued prefill, if it is idle (one prefill at a time)."""
        if g.busy or not g.queue:
            return
        r = g.queue.popleft()
        g.busy = True
        compute = g.start_prefill(r)
        t = self.tiers
        busy_s = (
            compute / self.prefill_tokens_per_s
            + r.host_tokens / t.host_load_tokens_per_s
            + r.disk_tokens / t.disk_load_tokens_per_s
        )
        self._push(self.now + busy_s, _Event.PREFILL_DONE, (g, r))


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, desc: str = "replay"):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc=desc, leave=False)


def format_result(r: dict) -> str:
    by_tier = r.get("hit_ratio_by_tier", {})
    tiers = ""
    if by_tier.get("host") or by_tier.get("disk") or r.get("host_capacity_tokens_per_group"):
        tiers = f" [gpu {by_tier['gpu']:.3f} host {by_tier['host']:.3f} disk {by_tier['disk']:.3f}]"
    return (
        f"{r['policy']:>16}  groups {r['groups']:2d}  hit {r['hit_ratio']:.3f}{tiers}  "
        f"(pooled LRU {r['pooled_lru_hit_ratio']:.3f}, infinite {r['infinite_hit_ratio']:.3f})  "
        f"imbalance {r['imbalance']:.2f}  TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s"
    )
