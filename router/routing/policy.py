"""Routing policies. ``kvgrid`` (the default) picks the group with the least estimated cost; the others are the
baselines it is measured against."""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

from router.routing.index import TierMatch

# Figures behind the default load weights (see ``CacheAwarePolicy``): a group's prefill speed, and how fast it loads
# cached KV back into its GPU pool from host RAM and from disk, all in tokens per second.
DEFAULT_PREFILL_TOKENS_PER_S = 16_000.0
DEFAULT_HOST_LOAD_TOKENS_PER_S = 400_000.0
DEFAULT_DISK_LOAD_TOKENS_PER_S = 40_000.0


@dataclass
class GroupLoad:
    """What a group still has to do: prefill tokens queued or running, and requests decoding."""

    queued_prefill_tokens: int = 0
    running: int = 0
    recent_prefill_tokens: float = 0.0  # prefill routed here, decayed over the router's recent_window_s


@dataclass
class RouteRequest:
    keys: list[bytes]  # the prompt's full-block keys (tenant-salted)
    num_tokens: int
    block_size: int
    cached_blocks: dict[str, int]  # leading blocks each group holds in any tier (index + predictions)
    # The same runs split by tier (``TierMatch``: of them, blocks to load from host RAM, from disk); a group
    # absent here holds its run in its GPU pool.
    cached_tiers: dict[str, TierMatch] = field(default_factory=dict)
    # Prefill-token equivalents a group would spend before computing (loading the request's LoRA adapter there).
    extra_tokens: dict[str, float] = field(default_factory=dict)

    def tier_tokens(self, group: str) -> tuple[int, int, int]:
        """(GPU, host, disk) tokens of this prompt ``group`` holds: its cached tokens split by the tier it would
        take them from."""
        cached = min(self.cached_blocks.get(group, 0) * self.block_size, self.num_tokens)
        t = self.cached_tiers.get(group)
        if t is None or not (t.host or t.disk):
            return cached, 0, 0
        lower = min(cached, (t.host + t.disk) * self.block_size)
        disk = min(lower, t.disk * self.block_size)
        return cached - lower, lower - disk, disk


def load_weight(load_tokens_per_s: float, prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S) -> float:
    """Prefill-token equivalents of loading one cached token: the time a load takes, counted in prefill time."""
    if load_tokens_per_s <= 0 or prefill_tokens_per_s <= 0:
        raise ValueError("load and prefill rates must be > 0 tokens/s")
    return prefill_tokens_per_s / load_tokens_per_s


DEFAULT_HOST_LOAD_WEIGHT = load_weight(DEFAULT_HOST_LOAD_TOKENS_PER_S)  # 0.04
DEFAULT_DISK_LOAD_WEIGHT = load_weight(DEFAULT_DISK_LOAD_TOKENS_PER_S)  # 0.4


class RoutingPolicy(ABC):
    name: str
    needs_all_keys = False  # True: RouteRequest.keys must hold every block's key, not only those matched
    # Prefill-token equivalents of loading one cached token back into the GPU pool from host RAM and from disk
    # (``load_weight``): what the router's queue bookkeeping charges a group for a lower-tier hit (``load_tokens``),
    # and, in ``CacheAwarePolicy``, what such a hit costs.
    host_load_weight = DEFAULT_HOST_LOAD_WEIGHT
    disk_load_weight = DEFAULT_DISK_LOAD_WEIGHT

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    @abstractmethod
    def choose(self, req: RouteRequest, loads: dict[str, GroupLoad]) -> str:
        """Pick one of ``loads``' groups (all routable) for ``req``."""

    def _least_loaded(self, groups: list[str], loads: dict[str, GroupLoad]) -> str:
        best = min(load_key(loads[g]) for g in groups)
        return self.rng.choice([g for g in groups if load_key(loads[g]) == best])

    def load_tokens(self, host_tokens: int, disk_tokens: int) -> int:
        """Prefill-token equivalents (rounded up) of loading ``host_tokens`` from host RAM and ``disk_tokens`` from
        disk: the time those loads take on the group, counted in prefill time."""
        return math.ceil(self.host_load_weight * host_tokens + self.disk_load_weight * disk_tokens)


def load_key(load: GroupLoad) -> tuple[int, int]:
    return (load.queued_prefill_tokens, load.running)


class CacheAwarePolicy(RoutingPolicy):
    """Least estimated cost, in prefill-token equivalents:

        recompute_weight x (tokens of this request the group does not hold)
        + host_load_weight x (tokens it holds in host RAM, not in its GPU pool)
        + disk_load_weight x (tokens it holds on disk only)
        + the prefill already queued there
        + decode_weight x the requests it is decoding
        + recent_weight x the prefill routed there lately (decayed)

    Recomputing a prefix costs the whole cluster, not just this request, so uncached tokens weigh more than
    queued ones (``recompute_weight``): a group holding the prefix keeps it until its queue is long enough to
    justify copying the work elsewhere; then the next request goes to a less busy group, which computes and
    from then on also holds the prefix (a hot prefix spreads to a second group instead of everything
    switching to round robin). The decayed recent work spreads new conversations over groups that have been
    doing less, so total work stays balanced when queues are short. Equal costs go to the less loaded group,
    then at random, so cold traffic never piles onto the first group. The defaults were tuned on the
    Mooncake conversation trace (``kvgrid replay``).

    A block held in a lower tier is a hit that costs a load: the group copies it back into its GPU pool instead
    of computing it. The load weights are that copy's time in prefill time (``load_weight``: prefill tokens/s
    over load tokens/s; by default 16k / 400k = 0.04 for host RAM and 16k / 40k = 0.4 for disk). They are not
    multiplied by ``recompute_weight``: a load occupies the group that does it, it does not duplicate work in
    the cluster. So at equal load a GPU hit beats a host hit, which beats a disk hit, which beats a miss.
    """

    name = "kvgrid"

    def __init__(
        self,
        decode_weight: float = 32.0,
        recompute_weight: float = 8.0,
        recent_weight: float = 0.1,
        host_load_weight: float = DEFAULT_HOST_LOAD_WEIGHT,
        disk_load_weight: float = DEFAULT_DISK_LOAD_WEIGHT,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        for what, w in (("host_load_weight", host_load_weight), ("disk_load_weight", disk_load_weight)):
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"{what} must be a finite number >= 0, not {w}")
        self.decode_weight = decode_weight
        self.recompute_weight = recompute_weight
        self.recent_weight = recent_weight
        self.host_load_weight = host_load_weight
        self.disk_load_weight = disk_load_weight

    def cost(self, req: RouteRequest, group: str, load: GroupLoad) -> float:
        gpu, host, disk = req.tier_tokens(group)
        uncached = req.num_tokens - gpu - host - disk
        return (
            self.recompute_weight * uncached
            + self.host_load_weight * host
            + self.disk_load_weight * disk
            + load.queued_prefill_tokens
            + self.decode_weight * load.running
            + self.recent_weight * load.recent_prefill_tokens
            + req.extra_tokens.get(group, 0.0)
        )

    def choose(self, req: RouteRequest, loads: dict[str, GroupLoad]) -> str:
        costs = {g: self.cost(req, g, load) for g, load in loads.items()}
        best = min(costs.values())
        return self._least_loaded([g for g, c in costs.items() if c == best], loads)


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.turn = 0

    def choose(self, req: RouteRequest, loads: dict[str, GroupLoad]) -> str:
        groups = sorted(loads)
        self.turn += 1
        return groups[(self.turn - 1) % len(groups)]


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def choose(self, req: RouteRequest, loads: dict[str, GroupLoad]) -> str:
        return self._least_loaded(list(loads), loads)


class PrefixAffinityPolicy(RoutingPolicy):
    """What common gateways do: each group keeps an approximate record of the prompts routed to it (not the
    workers' events); a request goes to the group with the longest match when that match covers at least
    ``match_ratio`` of the prompt, else to the group with the least recorded content; when the queues are
    imbalanced (max - min above ``abs_threshold`` tokens and max / min above ``rel_threshold``) it switches to
    the least loaded group."""

    name = "prefix_affinity"
    needs_all_keys = True

    def __init__(
        self,
        capacity_blocks: int = 1 << 20,
        match_ratio: float = 0.5,
        abs_threshold: int = 32 * 1024,
        rel_threshold: float = 1.5,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        self.capacity = capacity_blocks
        self.match_ratio = match_ratio
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        self.trees: dict[str, OrderedDict[bytes, None]] = {}

    def choose(self, req: RouteRequest, loads: dict[str, GroupLoad]) -> str:
        for g in loads:
            self.trees.setdefault(g, OrderedDict())
        queued = [loads[g].queued_prefill_tokens for g in loads]
        hi, lo = max(queued), min(queued)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * max(lo, 1):
            group = self._least_loaded(list(loads), loads)
        else:
            match = {g: self._match(self.trees[g], req.keys) for g in loads}
            best = max(match.values())
            if req.keys and best >= self.match_ratio * len(req.keys):
                group = self.rng.choice([g for g, m in match.items() if m == best])
            else:
                smallest = min(len(self.trees[g]) for g in loads)
                group = self.rng.choice([g for g in loads if len(self.trees[g]) == smallest])
        self._insert(self.trees[group], req.keys)
        return group

    @staticmethod
    def _match(tree: OrderedDict[bytes, None], keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in tree:
                break
            n += 1
        return n

    def _insert(self, tree: OrderedDict[bytes, None], keys: list[bytes]) -> None:
        for k in keys:
            tree[k] = None
            tree.move_to_end(k)
        while len(tree) > self.capacity:
            tree.popitem(last=False)


POLICIES = {p.name: p for p in (CacheAwarePolicy, RoundRobinPolicy, LeastLoadedPolicy, PrefixAffinityPolicy)}


def make_policy(name: str, seed: int = 0, **kwargs) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](seed=seed, **kwargs)
