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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.hashing import RootKeys, block_keys
from router.routing.policy import make_policy
from router.routing.router import Router
from router.routing.transport import InProcessTransport
from router.sim.trace import read_mooncake
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
    if tenants < 1:
        raise ValueError("tenants must be >= 1")
    root_key = RootKeys(REPLAY_SECRET)
    out = []
    for e in read_mooncake(path, limit):
        ids = list(e.hash_ids)
        tenant = (ids[1] if len(ids) > 1 else ids[0]) % tenants if ids else 0
        keys = block_keys(ids, 1, root_key(f"tenant-{tenant}"))
        out.append(TraceRequest(e.timestamp_s, e.input_length, e.output_length, keys))
    return out


@dataclass
class _Running:
    req: TraceRequest
    rid: str
    blocks: list[Block] = field(default_factory=list)
    hit_tokens: int = 0


class SimGroup:
    def __init__(self, name: str, num_blocks: int, block_size: int, transport: InProcessTransport) -> None:
        self.name = name
        self.block_size = block_size
        self.sink = _GroupSink(name, transport)
        self.pool = BlockPool(num_blocks, self.sink)
        self.queue: deque[_Running] = deque()
        self.busy = False
        self.prefill_tokens = 0
        self.uncacheable_tokens = 0

    def start_prefill(self, r: _Running) -> int:
        """Attach cached leading blocks, allocate the rest; returns the tokens to compute."""
        hits = self.pool.cached_prefix(r.req.keys)
        self.pool.touch(hits)
        r.hit_tokens = min(len(hits) * self.block_size, r.req.input_length)
        need = len(r.req.keys) - len(hits)
        fresh = self.pool.allocate(min(need, self.pool.num_free))
        r.blocks = hits + fresh
        compute = r.req.input_length - r.hit_tokens
        self.prefill_tokens += compute
        return compute

    def end_prefill(self, r: _Running) -> None:
        n_hit = r.hit_tokens // self.block_size if r.hit_tokens < r.req.input_length else len(r.req.keys)
        new = r.blocks[n_hit:]
        keys = r.req.keys[n_hit : n_hit + len(new)]
        # Only full blocks are registered; the trace's last block may be partial.
        full = min(len(keys), r.req.input_length // self.block_size - n_hit)
        if full > 0:
            self.pool.cache(new[:full], keys[:full], r.req.keys[n_hit - 1] if n_hit else None)
        self.uncacheable_tokens += (len(r.req.keys) - n_hit - len(new)) * self.block_size

    def finish(self, r: _Running) -> None:
        self.pool.free(reversed(r.blocks))


class _GroupSink:
    def __init__(self, name: str, transport: InProcessTransport) -> None:
        self.name, self.transport = name, transport

    def publish(self, event) -> None:
        self.transport.publish(self.name, [event])


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
) -> dict:
    """Run ``trace`` through the router and ``groups`` simulated groups; returns the figures of the run."""
    if groups < 1 or capacity_tokens < block_size or block_size < 1:
        raise ValueError("need groups >= 1 and capacity_tokens >= block_size >= 1")
    sim = _Simulation(groups, capacity_tokens, block_size, policy, prefill_tokens_per_s, decode_s_per_token, seed)
    bar = _progress(len(trace), progress)
    sim.run(trace, bar.update)
    bar.close()

    total = sum(r.input_length for r in trace)
    computed = [g.prefill_tokens for g in sim.groups.values()]
    lru, inf = reference_hit_ratios(trace, capacity_tokens * groups, block_size)
    ttfts = sorted(sim.ttfts)
    return {
        "policy": policy,
        "groups": groups,
        "capacity_tokens_per_group": capacity_tokens,
        "block_size": block_size,
        "requests": len(trace),
        "hit_ratio": 1 - sum(computed) / total,
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
    ) -> None:
        transport = InProcessTransport()
        names = [f"g{i}" for i in range(groups)]
        self.now = 0.0
        self.router = Router(
            names,
            REPLAY_SECRET,
            block_size,
            make_policy(policy, seed=seed),
            prediction_ttl_s=60.0,
            events=transport.subscribe(),
            clock=lambda: self.now,
        )
        self.groups = {n: SimGroup(n, capacity_tokens // block_size, block_size, transport) for n in names}
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
        self._push(self.now + g.start_prefill(r) / self.prefill_tokens_per_s, _Event.PREFILL_DONE, (g, r))


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="replay", leave=False)


def format_result(r: dict) -> str:
    return (
        f"{r['policy']:>16}  groups {r['groups']:2d}  hit {r['hit_ratio']:.3f}  "
        f"(pooled LRU {r['pooled_lru_hit_ratio']:.3f}, infinite {r['infinite_hit_ratio']:.3f})  "
        f"imbalance {r['imbalance']:.2f}  TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s"
    )
