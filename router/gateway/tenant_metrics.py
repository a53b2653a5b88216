"""A tenant's Prometheus metrics in one gateway replica (``TenantMetrics``): traffic and cache counters, cost at its
prices, the cache-read share over recent windows, latency histograms and the hit-rate drop alarm
(router/gateway/monitoring.py). router/gateway/replica_metrics.py merges them over the replicas."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.config import MonitoringConfig
from common.outputs import Timings
from router.gateway.economics import RequestCost, dollars
from router.gateway.monitoring import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    PHASE_BUCKETS,
    TTFT_BUCKETS,
    WINDOWS,
    Alert,
    DropAlarm,
    RequestTiming,
    ShareWindows,
)


class TenantMetrics:
    """A tenant's Prometheus metrics in this replica: traffic and cache counters, cost at its prices, the cache-read
    share over recent windows, latency histograms and the hit-rate drop alarm (router/gateway/monitoring.py), each
    labelled ``tenant`` and ``model_name`` (the served model id, as vLLM labels its series). ``GET /{tenant}/metrics``
    shows them merged over every gateway replica (router/gateway/replica_metrics.py).

    vLLM's names for the same figures (kvgrid keeps its own; a query can be written for either):
    ``kvgrid_requests_total`` ~ ``vllm:request_success_total`` (summed over ``finished_reason``),
    ``kvgrid_prompt_tokens_total`` ~ ``vllm:prompt_tokens_total``, ``kvgrid_output_tokens_total`` ~
    ``vllm:generation_tokens_total``, ``kvgrid_cached_tokens_total`` / ``kvgrid_prompt_tokens_total`` ~
    ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (tokens; vLLM counts the engine's
    lookups, kvgrid the reuse billed to the tenant), ``kvgrid_time_to_first_token_seconds``,
    ``kvgrid_inter_token_latency_seconds`` and ``kvgrid_e2e_request_latency_seconds`` ~ vLLM's
    ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (formerly
    ``vllm:time_per_output_token_seconds``) and ``vllm:e2e_request_latency_seconds`` (the same buckets; measured at
    the gateway, so they include routing and the network to the group). ``kvgrid_request_queue_time_seconds``,
    ``kvgrid_request_prefill_time_seconds`` and ``kvgrid_request_decode_time_seconds`` ~
    ``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds`` and
    ``vllm:request_decode_time_seconds`` (the engine's own clock: common/outputs.py ``Timings``; an ``n`` > 1 request
    once, from its first choice scheduled to its last finished). ``kvgrid_prefix_cache_hit_tokens_total{tier}``
    (tier ``gpu``, ``host`` or ``disk``) ~ ``vllm:prefix_cache_hits_total`` split by where the reused blocks were:
    the tokens the group reused (its report), split by the tiers the router found them in at routing time (the
    host and disk parts capped at the reuse, the GPU part the rest); a tier's hit rate is its rate over
    ``rate(kvgrid_prompt_tokens_total)``."""

    def __init__(
        self, tenant: str, block_size: int = 16, monitoring: MonitoringConfig | None = None, model_name: str = ""
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lbl = self.registry, ["tenant", "model_name"]
        self.requests = Counter("kvgrid_requests", "Requests served", lbl, registry=r)
        self.prompt = Counter("kvgrid_prompt_tokens", "Prompt tokens", lbl, registry=r)
        self.cached = Counter("kvgrid_cached_tokens", "Prompt tokens served from the prefix cache", lbl, registry=r)
        self.output = Counter("kvgrid_output_tokens", "Output tokens", lbl, registry=r)
        self.hit_rate = Gauge("kvgrid_prefix_hit_rate", "Cached / prompt tokens so far", lbl, registry=r)
        self.predicted = Counter(
            "kvgrid_router_predicted_cached_tokens", "Cached tokens the router expected", lbl, registry=r
        )
        self.actual = Counter("kvgrid_router_actual_cached_tokens", "Cached tokens the group reported", lbl, registry=r)
        self.writes = Counter("kvgrid_cache_write_tokens", "Prompt tokens written to explicit entries", lbl, registry=r)
        self.cost = Counter("kvgrid_cost_dollars", "What the traffic cost at the tenant's prices", lbl, registry=r)
        self.uncached_cost = Counter(
            "kvgrid_cost_without_cache_dollars", "The same traffic's cost without the cache", lbl, registry=r
        )
        self.window_rate = Gauge(
            "kvgrid_prefix_hit_rate_window", "Cached / prompt tokens over the last window", [*lbl, "window"], registry=r
        )
        self.ttft = Histogram(
            "kvgrid_time_to_first_token_seconds", "Time to first token", lbl, registry=r, buckets=TTFT_BUCKETS
        )
        self.itl = Histogram(
            "kvgrid_inter_token_latency_seconds", "Time between output tokens", lbl, registry=r, buckets=ITL_BUCKETS
        )
        self.e2e = Histogram(
            "kvgrid_e2e_request_latency_seconds", "End-to-end request latency", lbl, registry=r, buckets=E2E_BUCKETS
        )
        self.queue = Histogram(
            "kvgrid_request_queue_time_seconds", "Time waiting in the group", lbl, registry=r, buckets=PHASE_BUCKETS
        )
        self.prefill = Histogram(
            "kvgrid_request_prefill_time_seconds", "Prefill time", lbl, registry=r, buckets=PHASE_BUCKETS
        )
        self.decode = Histogram(
            "kvgrid_request_decode_time_seconds", "Decode time", lbl, registry=r, buckets=PHASE_BUCKETS
        )
        self.tier_hits = Counter(
            "kvgrid_prefix_cache_hit_tokens", "Prompt tokens the group reused, by KV tier", [*lbl, "tier"], registry=r
        )
        self.alerts = Counter("kvgrid_hit_rate_drop_alerts", "Hit-rate drop alerts", lbl, registry=r)
        self.alert_active = Gauge("kvgrid_hit_rate_drop_active", "1 during a hit-rate drop", lbl, registry=r)
        self.alert_block = Gauge(
            "kvgrid_hit_rate_drop_block", "The block where prompts stopped matching (last alert)", lbl, registry=r
        )
        # Its budget (router/gateway/budgets.py): the period's spend as Redis last told this replica, 1 past soft.
        self.budget_spent = Gauge("kvgrid_budget_spent_dollars", "Spent in the budget's period", lbl, registry=r)
        self.budget_soft = Gauge("kvgrid_budget_soft_exceeded", "1 once the soft budget is passed", lbl, registry=r)
        self.budget_refused = Counter("kvgrid_budget_refused", "Requests refused by the hard budget", lbl, registry=r)
        self.tenant = tenant
        mon = monitoring or MonitoringConfig()
        self.alarm: DropAlarm | None = None
        if mon.drop_alerts:
            self.alarm = DropAlarm(
                tenant, block_size, mon.window, mon.baseline, mon.drop_ratio, mon.min_share, streak=mon.streak
            )
        self.windows = self.alarm.windows if self.alarm is not None else ShareWindows()
        self.clock = time.time  # the alarm's clock (a test's simulated one)
        self._prompt_total = self._cached_total = 0
        self.last_alert: Alert | None = None  # this replica's newest (its time decides the merged drop block)
        # Every series shows from the start, at 0; the children are kept (a labels() lookup per use costs more).
        self._n = {
            name: getattr(self, name).labels(tenant, model_name)
            for name in (
                *("requests", "prompt", "cached", "output", "predicted", "actual", "writes", "cost"),
                *("uncached_cost", "alerts", "hit_rate", "alert_active", "alert_block", "ttft", "itl", "e2e"),
                *("queue", "prefill", "decode", "budget_spent", "budget_soft", "budget_refused"),
            )
        }
        self._windows = {w: self.window_rate.labels(tenant, model_name, w) for w in WINDOWS}
        self._tiers = {tier: self.tier_hits.labels(tenant, model_name, tier) for tier in ("gpu", "host", "disk")}

    def record(
        self,
        prompt: int,
        cached: int,
        output: int,
        predicted: int,
        actual: int,
        prompt_ids: list[int] | None = None,
        cost: RequestCost | None = None,
        write: int = 0,
        now: float | None = None,
    ) -> Alert | None:
        """``cached``: the reuse reported to the client (the tenant's policy); ``actual``: what the group reused,
        against which the router's ``predicted`` is judged. The alarm's alert when this request starts a drop."""
        n = self._n
        n["requests"].inc()
        n["prompt"].inc(prompt)
        n["cached"].inc(cached)
        n["output"].inc(output)
        n["predicted"].inc(predicted)
        n["actual"].inc(actual)
        n["writes"].inc(write)
        if cost is not None:
            n["cost"].inc(dollars(cost.cost))
            n["uncached_cost"].inc(dollars(cost.uncached_cost))
        self._prompt_total += prompt
        self._cached_total += cached
        n["hit_rate"].set(self._cached_total / max(1, self._prompt_total))
        now = self.clock() if now is None else now
        alert = None
        if self.alarm is not None:
            alert = self.alarm.observe(prompt_ids if prompt_ids is not None else [0] * prompt, cached, now)
            n["alert_active"].set(0 if self.alarm.active is None else 1)
        else:
            self.windows.add(now, prompt, cached)
        for w, seconds in WINDOWS.items():
            self._windows[w].set(self.windows.share(now, seconds))
        if alert is not None:
            n["alerts"].inc()
            n["alert_block"].set(alert.block)
            self.last_alert = alert
        return alert

    def observe(self, timing: RequestTiming) -> None:
        """A finished request's latencies."""
        if timing.ttft is not None:
            self._n["ttft"].observe(timing.ttft)
        itl = self._n["itl"]
        for gap in timing.gaps:
            itl.observe(gap)
        if timing.e2e is not None:
            self._n["e2e"].observe(timing.e2e)

    def observe_group(self, timings: list[Timings], reused: int, host: int, disk: int) -> None:
        """A finished request's time in its group (the ``Timings`` of each choice's final output: queue, prefill,
        decode) and the ``reused`` prompt tokens of it, of which the router found up to ``host`` in host RAM and up
        to ``disk`` on disk."""
        scheduled = min((t.scheduled for t in timings if t.scheduled is not None), default=None)
        first = min((t.first_token for t in timings if t.first_token is not None), default=None)
        if timings:
            finished = max(t.finished for t in timings)
            self._n["queue"].observe(finished if scheduled is None else scheduled)
            if scheduled is not None:
                self._n["prefill"].observe(max(0.0, (finished if first is None else first) - scheduled))
                if first is not None:
                    self._n["decode"].observe(max(0.0, finished - first))
        if reused > 0:
            disk = min(disk, reused)
            host = min(host, reused - disk)
            self._tiers["gpu"].inc(reused - host - disk)
            self._tiers["host"].inc(host)
            self._tiers["disk"].inc(disk)

    def budget(self, spent: float, soft_exceeded: bool) -> None:
        """The budget's spend this period and whether it passed the soft threshold."""
        self._n["budget_spent"].set(spent)
        self._n["budget_soft"].set(1 if soft_exceeded else 0)

    def budget_refusal(self) -> None:
        self._n["budget_refused"].inc()
