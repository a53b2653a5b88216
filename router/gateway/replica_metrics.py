"""Metrics that add up across gateway replicas: whichever replica answers a scrape of ``GET /{tenant}/metrics``, it
shows every replica's samples exactly once, and no counter ever goes down while replicas come and go.

Each replica (router/gateway/server.py; a node's replicas share ``http.port``, so successive scrapes land on
different ones) keeps its own prometheus_client registries. Every ``PUBLISH_INTERVAL_S`` (all tenants), and right
before it answers a scrape (that tenant's), a replica publishes their samples to Redis in one atomic script:

* **Counters, histograms, summaries** (every sample that only grows: ``_total``, ``_bucket``, ``_count``,
  ``_sum``) go into one persistent hash per scope (a tenant), ``kvgrid:metrics:{scope}:totals``, as increments:
  the replica sends its cumulative values, and the script adds to the totals what each value grew since the value
  it last applied for that replica (``kvgrid:metrics:{scope}:seen:{replica}``; only ever raised). Sending the same
  values twice (a reply lost to a timeout, then a retry) adds nothing; values arriving out of order add nothing
  and lower nothing. A replica that dies has already added everything it published: its counts stay in the
  totals, nothing has to be folded in when it goes, and the totals can only grow. (Lost: what it counted in its
  last interval, under a second.)
* **Gauges** are a replica's present state: each replica's current values are a hash of their own
  (``kvgrid:metrics:{scope}:gauges:{replica}``), read only while the replica's heartbeat
  (``kvgrid:metrics:alive:{replica}``, ``ALIVE_TTL_S``) lives, and merged per gauge (``GAUGE_RULES``): ``sum``
  (the default: an amount held by each replica), ``max`` (a flag: a hit-rate drop seen by any replica), ``latest``
  (a value of the last event: the replica with the newest ``#time`` wins), ``ratio`` (a share: the sums of the
  replicas' numerators and denominators, ``#num`` / ``#den``, never an average of their shares), or a ratio of
  two merged counters (the share of cached tokens since the start, from every replica that ever served).

The merged samples keep the families, names and labels of the replica's own registry (no ``replica`` label: a
dashboard's queries read the same series with one replica or ten), without the ``_created`` samples (each
replica's start time, not a total's). Redis down: the scrape answers 503 (a failed scrape is a gap to Prometheus,
where this replica's own, smaller counts would read as a counter reset).

Never in a request's way: publishing runs in a background task, each Redis call bounded by twice the client's
timeout; a failure is logged once (and again when Redis is back) and retried on the next round with every value
(the script makes resending harmless). Taking a tenant's samples costs about 0.2 ms; the interval stretches so that
it takes at most ``MAX_LOOP_SHARE`` of the event loop with many tenants.

Keys live ``STATE_TTL_S`` after a replica's last write (a full resend every ``REFRESH_S`` keeps a live one's); a
replica cut off from Redis for longer would count its earlier samples again on return (a counter that jumps up,
never one that goes down). The admin API's metrics (router/gateway/admin.py) need none of this: its group gauges
are read from the groups at each scrape and its tenant counters from the usage ledger and keep-alive counters in
Redis, the same whichever replica answers."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import redis.asyncio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from router.gateway.monitoring import WINDOWS
from router.gateway.store import StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

PUBLISH_INTERVAL_S = 1.0
ALIVE_TTL_S = 10  # a replica silent for this long no longer counts for gauges (its counters stay)
STATE_TTL_S = 86400  # a replica's applied values and gauges, after its last write
REFRESH_S = 600.0  # every value is resent this often (keeps STATE_TTL_S from running out under a live replica)
MAX_LOOP_SHARE = 0.02  # taking the samples occupies at most this share of the event loop
# A tenant whose samples did not change is taken again after 2, 4, then every IDLE_ROUNDS rounds (a scrape of it
# publishes it at once): a hundred idle tenants cost a dozen snapshots a second, not a hundred.
IDLE_ROUNDS = 8
PREFIX = "kvgrid:metrics"
COUNTING = frozenset({"counter", "histogram", "summary"})  # families whose samples only grow

# A sample: (family, sample name, labels in the registry's order). Per-replica inputs of a merge that are no sample
# of the registry have a sample name with ``#`` in it (``name#num``); they are never shown.
Key = tuple[str, str, tuple[tuple[str, str], ...]]

# How the live replicas' values of a gauge family become one; a family not named here is summed.
GAUGE_RULES: dict[str, str | tuple[str, str]] = {
    # The cached share since the start: merged cached / prompt tokens (every replica that ever served).
    "kvgrid_prefix_hit_rate": ("kvgrid_cached_tokens_total", "kvgrid_prompt_tokens_total"),
    "kvgrid_prefix_hit_rate_window": "ratio",  # cached / prompt tokens in the window, summed over replicas
    "kvgrid_hit_rate_drop_active": "max",  # 1 while any replica's alarm sees a drop
    "kvgrid_hit_rate_drop_block": "latest",  # the block of the newest alert, whichever replica raised it
    # A budget's spend as each replica last settled it: it only grows within a period, so the largest is newest.
    "kvgrid_budget_spent_dollars": "max",
    "kvgrid_budget_soft_exceeded": "max",
}


# -- taking and merging samples (pure) ---------------------------------------------------------------------------


@dataclass
class Snapshot:
    """One registry's samples now: ``families`` (name -> (type, help), in the registry's order), ``order`` (the
    samples' keys in the registry's order), the growing samples in ``counts`` and the others in ``gauges``."""

    families: dict[str, tuple[str, str]]
    order: list[Key]
    counts: dict[Key, float]
    gauges: dict[Key, float]


def take(registry: CollectorRegistry, extras: Mapping[Key, float] | None = None) -> Snapshot:
    """``registry``'s samples (``_created`` ones left out), and ``extras`` (a merge's hidden inputs) as gauges."""
    snap = Snapshot({}, [], {}, {})
    for fam in registry.collect():
        snap.families[fam.name] = (fam.type, fam.documentation)
        counting = fam.type in COUNTING
        into = snap.counts if counting else snap.gauges
        for s in fam.samples:
            if counting and s.name.endswith("_created"):
                continue
            key = (fam.name, s.name, tuple(s.labels.items()))
            into[key] = s.value
            snap.order.append(key)
    if extras:
        snap.gauges.update(extras)
    return snap


def encode(key: Key) -> str:
    return json.dumps([key[0], key[1], [list(p) for p in key[2]]], separators=(",", ":"), ensure_ascii=False)


def decode(raw: bytes | str) -> Key:
    fam, name, labels = json.loads(raw)
    return fam, name, tuple((str(k), str(v)) for k, v in labels)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def merge_gauges(
    replicas: Iterable[Mapping[Key, float]],
    counts: Mapping[Key, float],
    rules: Mapping[str, str | tuple[str, str]] = GAUGE_RULES,
) -> dict[Key, float]:
    """The gauges of the live ``replicas`` (each one's gauges with their hidden inputs) as one set, by ``rules``;
    ``counts``: the merged counters (for the rules that are a ratio of two)."""
    replicas = list(replicas)
    shown: dict[Key, list[float]] = {}
    for g in replicas:
        for k, v in g.items():
            if "#" not in k[1]:
                shown.setdefault(k, []).append(v)
    out: dict[Key, float] = {}
    for k, values in shown.items():
        fam, name, labels = k
        rule = rules.get(fam, "sum")
        if isinstance(rule, tuple):
            continue  # from the counters, below
        if rule == "max":
            out[k] = max(values)
        elif rule == "ratio":
            num = sum(g.get((fam, name + "#num", labels), 0.0) for g in replicas)
            den = sum(g.get((fam, name + "#den", labels), 0.0) for g in replicas)
            out[k] = _ratio(num, den)
        elif rule == "latest":
            newest = max((g.get((fam, name + "#time", labels), 0.0), g[k]) for g in replicas if k in g)
            out[k] = newest[1]
        else:
            out[k] = sum(values)
    for fam, rule in rules.items():
        if isinstance(rule, tuple):
            num_name, den_name = rule
            dens = {k[2]: v for k, v in counts.items() if k[1] == den_name}
            for k, v in counts.items():
                if k[1] == num_name:
                    out[(fam, fam, k[2])] = _ratio(v, dens.get(k[2], 0.0))
    return out


_SUFFIX_RANK = {"_bucket": 0, "_count": 1, "_sum": 2}


def _sort_key(key: Key) -> tuple:
    """Samples the replica's registry does not have (a label set only another replica saw), sorted as a registry
    lists them: by labels, a histogram's buckets by ``le``, then its count and sum."""
    fam, name, labels = key
    le = math.inf
    rest = []
    for k, v in labels:
        if k == "le":
            le = float(v)
        else:
            rest.append((k, v))
    suffix = name[len(fam) :]
    return (tuple(rest), _SUFFIX_RANK.get(suffix, 3), le, name)


def render(local: Snapshot, counts: Mapping[Key, float], gauges: Mapping[Key, float]) -> bytes:
    """Prometheus's text format: ``local``'s families, with the merged ``counts`` and ``gauges`` as their samples
    (a sample of ``local`` that no merge holds shows at 0; merged samples of families ``local`` lacks are left
    out)."""
    values = {**counts, **gauges}
    by_family: dict[str, list[Key]] = {name: [] for name in local.families}
    listed = set()
    for k in local.order:
        if k not in listed:
            by_family[k[0]].append(k)
            listed.add(k)
    extra = sorted((k for k in values if k not in listed and k[0] in by_family and "#" not in k[1]), key=_sort_key)
    for k in extra:
        by_family[k[0]].append(k)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([_metric(name, *local.families[name], keys, values) for name, keys in by_family.items()]))
    return generate_latest(registry)


def _metric(name: str, typ: str, doc: str, keys: list[Key], values: Mapping[Key, float]) -> Metric:
    m = Metric(name, doc, typ)
    for k in keys:
        m.add_sample(k[1], dict(k[2]), values.get(k, 0.0))
    return m


class _Fixed:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


# -- a tenant's hidden inputs --------------------------------------------------------------------------------------


def tenant_extras(m: Any) -> dict[Key, float]:
    """What the merge of a tenant's gauges needs besides their values (``TenantMetrics``,
    router/gateway/tenant_metrics.py): each window's cached and prompt tokens (``kvgrid_prefix_hit_rate_window``),
    and the time of the replica's last alert (``kvgrid_hit_rate_drop_block``)."""
    base = (("tenant", m.tenant), ("model_name", m.model_name))
    now = m.clock()
    out: dict[Key, float] = {}
    fam = "kvgrid_prefix_hit_rate_window"
    for window, seconds in WINDOWS.items():
        _, prompt, cached = m.windows.totals(now, seconds)
        labels = (*base, ("window", window))
        out[(fam, fam + "#num", labels)] = float(cached)
        out[(fam, fam + "#den", labels)] = float(prompt)
    fam = "kvgrid_hit_rate_drop_block"
    alert = m.last_alert
    out[(fam, fam + "#time", base)] = float(alert.time) if alert is not None else 0.0
    return out


# -- Redis -------------------------------------------------------------------------------------------------------

# KEYS: this replica's heartbeat, the set of replicas, then per scope (totals, this replica's applied values, its
# gauges). ARGV: replica id, heartbeat TTL, state TTL, then per scope: whether Redis acknowledged counters of the
# scope from this replica before (1/0), the number of counter pairs, the number of gauge pairs, the counter (field,
# value) pairs, the gauge pairs (all of them: the hash is replaced). The applied values hold a field "#" from the
# first write on. Returns the scopes (1-based) whose applied values were missing though acknowledged before (Redis
# lost them): the replica resends everything of those.
_PUBLISH = """
redis.call('SET', KEYS[1], '1', 'EX', tonumber(ARGV[2]))
redis.call('SADD', KEYS[2], ARGV[1])
local ttl = tonumber(ARGV[3])
local a = 4
local lost = {}
for k = 3, #KEYS, 3 do
  local totals, seen, gauges = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local known, nc, ng = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  if nc > 0 and redis.call('EXISTS', seen) == 0 then
    if known == '1' then lost[#lost + 1] = (k - 3) / 3 + 1 end
    redis.call('HSET', seen, '#', '1')
  end
  for i = 1, nc do
    local f, v = ARGV[a], ARGV[a + 1]
    a = a + 2
    local new = tonumber(v)
    local old = tonumber(redis.call('HGET', seen, f) or '0')
    if new > old then
      redis.call('HINCRBYFLOAT', totals, f, string.format('%.17g', new - old))
      redis.call('HSET', seen, f, v)
    end
  end
  if nc > 0 then redis.call('EXPIRE', seen, ttl) end
  if ng > 0 then
    redis.call('DEL', gauges)
    for i = 1, ng do
      redis.call('HSET', gauges, ARGV[a], ARGV[a + 1])
      a = a + 2
    end
    redis.call('EXPIRE', gauges, ttl)
  end
end
return lost
"""


def _keys(scope: str, replica: str) -> tuple[str, str, str]:
    return (f"{PREFIX}:{scope}:totals", f"{PREFIX}:{scope}:seen:{replica}", f"{PREFIX}:{scope}:gauges:{replica}")


def _alive_key(replica: str) -> str:
    return f"{PREFIX}:alive:{replica}"


REPLICAS_KEY = f"{PREFIX}:replicas"


@dataclass
class Source:
    """A registry published under a scope, with the hidden inputs of its gauges' merge (``extras``)."""

    registry: CollectorRegistry
    extras: Callable[[], Mapping[Key, float]] | None = None

    def take(self) -> Snapshot:
        return take(self.registry, self.extras() if self.extras is not None else None)


def _timeout_of(client: redis.asyncio.Redis) -> float:
    return client.connection_pool.connection_kwargs.get("socket_timeout") or 1.0


class ReplicaMetrics:
    """One replica's publisher of its registries (``sources``, by scope) and the merged view of every replica's.
    ``start`` runs the publisher in the running event loop; ``exposition`` answers a scrape; ``close`` publishes a
    last time and withdraws this replica's gauges."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        sources: Mapping[str, Source],
        interval_s: float = PUBLISH_INTERVAL_S,
        replica_id: str | None = None,
    ) -> None:
        self.r = client
        self.sources = dict(sources)
        self.interval_s = interval_s
        self.replica = replica_id or secrets.token_hex(8)
        self.deadline_s = 2 * _timeout_of(client)
        self._publish = client.register_script(_PUBLISH)
        self._sent_counts: dict[str, dict[Key, float]] = {}  # per scope: what Redis acknowledged
        self._sent_gauges: dict[str, dict[Key, float]] = {}
        self._codes: dict[Key, str] = {}  # keys' encodings, made once
        self._refreshed = time.monotonic()
        self._take_s = 0.0  # how long the last round took to take the samples
        self._idle: dict[str, tuple[int, int]] = {}  # scope -> (rounds to skip, the next backoff) while unchanged
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._closed = False

    # -- publishing --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background publisher in the running event loop (idempotent; a no-op without a loop, or once
        closed: ``exposition`` starts it then)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._closed or (self._task is not None and not self._task.done() and self._task.get_loop() is loop):
            return
        self._lock, self._stop = asyncio.Lock(), asyncio.Event()
        self._task = loop.create_task(self._publish_forever(), name="kvgrid-metrics-publish")

    async def _publish_forever(self) -> None:
        assert self._stop is not None
        failing = False  # log when publishing stops and starts working again, not every round between
        while True:
            try:
                await self.publish()
            except StoreUnavailable as exc:
                if not failing:
                    log.warning("metrics: %s; this replica's samples are published again once Redis is back", exc)
                failing = True
            except Exception:  # a bug must not end publishing silently
                log.exception("metrics: publishing failed")
            else:
                if failing:
                    log.warning("metrics: Redis is back; this replica's samples are published again")
                failing = False
            wait = max(self.interval_s, self._take_s / MAX_LOOP_SHARE)
            try:
                await asyncio.wait_for(self._stop.wait(), wait)
                return
            except TimeoutError:
                pass

    async def publish(self, scopes: Iterable[str] | None = None) -> dict[str, Snapshot]:
        """Write what changed in ``scopes`` (default: all, and every value every ``REFRESH_S``) since Redis last
        acknowledged, in one script; the snapshots taken."""
        if self._lock is None:
            self.start()
        if self._lock is None:  # no event loop to start on (cannot happen in an async caller)
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._publish_once(scopes)

    async def _publish_once(self, scopes: Iterable[str] | None = None) -> dict[str, Snapshot]:
        t0 = time.perf_counter()
        full = scopes is None and time.monotonic() - self._refreshed >= REFRESH_S
        keys = [_alive_key(self.replica), REPLICAS_KEY]
        args: list[Any] = [self.replica, ALIVE_TTL_S, STATE_TTL_S]
        sent: list[tuple[str, dict[Key, float], dict[Key, float]]] = []
        snaps: dict[str, Snapshot] = {}
        for scope in self.sources if scopes is None else scopes:
            skip, backoff = self._idle.get(scope, (0, 1))
            if scopes is None and not full and skip > 0:
                self._idle[scope] = (skip - 1, backoff)
                continue
            snap = snaps[scope] = self.sources[scope].take()
            old_c = {} if full else self._sent_counts.get(scope, {})
            old_g = None if full else self._sent_gauges.get(scope)
            counts = {k: v for k, v in snap.counts.items() if old_c.get(k) != v}
            gauges = snap.gauges if snap.gauges != old_g else {}
            if not counts and not gauges:
                if scopes is None:
                    self._idle[scope] = (backoff, min(2 * backoff, IDLE_ROUNDS))
                continue
            self._idle.pop(scope, None)
            keys += _keys(scope, self.replica)
            args += [1 if scope in self._sent_counts else 0, len(counts), len(gauges)]
            for pairs in (counts, gauges):
                for k, v in pairs.items():
                    args += [self._code(k), repr(float(v))]
            sent.append((scope, snap.counts, snap.gauges))
        if scopes is None:  # a scrape's publish (its scope alone) does not stretch the interval
            self._take_s = time.perf_counter() - t0
        try:
            lost = await self._bounded(self._publish(keys=keys, args=args))
        except StoreUnavailable:
            self._sent_counts.clear()  # Redis may have lost or kept any of it: everything again next time
            self._sent_gauges.clear()
            raise
        if full:
            self._refreshed = time.monotonic()
        for scope, counts, gauges in sent:
            self._sent_counts[scope] = counts
            self._sent_gauges[scope] = gauges
        for i in lost or []:  # Redis lost this replica's applied values (a restart without its data)
            scope = sent[int(i) - 1][0]
            self._sent_counts.pop(scope, None)
            self._sent_gauges.pop(scope, None)
        return snaps

    def _code(self, key: Key) -> str:
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = encode(key)
        return code

    async def _bounded(self, op: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self.deadline_s):
                return await op
        except (redis.RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"redis unavailable: {str(exc) or type(exc).__name__}") from None

    # -- reading -----------------------------------------------------------------------------------------------

    async def merged(self, scope: str) -> tuple[dict[Key, float], list[dict[Key, float]]]:
        """Every replica's counters of ``scope`` (summed), and each live replica's gauges."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(f"{PREFIX}:{scope}:totals")
        pipe.smembers(REPLICAS_KEY)
        raw_totals, members = await self._bounded(pipe.execute())
        replicas = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
        live: list[dict[Key, float]] = []
        if replicas:
            pipe = self.r.pipeline(transaction=False)
            for rid in replicas:
                pipe.exists(_alive_key(rid))
                pipe.hgetall(_keys(scope, rid)[2])
            answers = await self._bounded(pipe.execute())
            dead = []
            for i, rid in enumerate(replicas):
                if answers[2 * i]:
                    live.append(_floats(answers[2 * i + 1]))
                else:
                    dead.append(rid)
            if dead:  # forgotten; one that was only slow adds itself again with its next heartbeat
                await self._bounded(self.r.srem(REPLICAS_KEY, *dead))
        return _floats(raw_totals), live

    async def exposition(self, scope: str) -> bytes:
        """``scope``'s samples of every replica, after publishing this replica's own (StoreUnavailable without
        Redis)."""
        local = (await self.publish([scope]))[scope]
        counts, live = await self.merged(scope)
        return render(local, counts, merge_gauges(live, counts))

    async def close(self) -> None:
        """Publish a last time and withdraw this replica's gauges (its counters stay in the totals)."""
        if self._closed:
            return
        self._closed = True
        if self._stop is not None:
            self._stop.set()
        if self._task is not None and self._task.get_loop() is asyncio.get_running_loop():
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                await self._publish_once()
                pipe = self.r.pipeline(transaction=False)
                pipe.delete(_alive_key(self.replica), *(_keys(scope, self.replica)[2] for scope in self.sources))
                pipe.srem(REPLICAS_KEY, self.replica)
                await self._bounded(pipe.execute())
        except StoreUnavailable as exc:
            log.warning("metrics: this replica's last samples were not published (%s)", exc)


def _floats(raw: Mapping[bytes | str, bytes | str]) -> dict[Key, float]:
    out = {}
    for k, v in raw.items():
        try:
            out[decode(k)] = float(v)
        except (ValueError, TypeError):  # not ours: skipped
            continue
    return out
