"""Per-tenant cache monitoring in a gateway replica (pure logic, any clock): the cache-read share over recent
windows (1 min, 5 min, 1 h), a request's latencies, and the hit-rate drop alarm.

The alarm watches for a tenant whose steady cache-read share falls sharply, the signature of a release that
changed the prompt prefix: the share over the last ``window_s`` (1 min) below ``drop_ratio`` (half) of the share
over the ``baseline_s`` (5 min) before it, with enough traffic in both (``min_requests``) and a baseline worth
watching (``min_share``). It fires once per drop and re-arms when the share recovers, or when the low share has
become the baseline. An alert names the block where the new prompts stopped matching the last prompt that hit
well before the drop."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

BUCKET_S = 10.0  # the windows' resolution
WINDOWS = {"1m": 60.0, "5m": 300.0, "1h": 3600.0}


class ShareWindows:
    """Prompt and cached tokens, requests and the best single request's share per ``BUCKET_S`` bucket over the
    last ``span_s``."""

    def __init__(self, span_s: float = 3600.0 + 600.0, bucket_s: float = BUCKET_S) -> None:
        self.bucket_s = bucket_s
        self.span = int(span_s // bucket_s) + 1
        # [bucket index, requests, prompt tokens, cached tokens, best request share]
        self.buckets: deque[list] = deque()
        self._frozen: dict[tuple, tuple[int, int, int, float]] = {}  # window -> sums of its buckets but the newest

    def add(self, now: float, prompt: int, cached: int) -> None:
        i = int(now // self.bucket_s)
        if self.buckets and i < self.buckets[-1][0]:
            i = self.buckets[-1][0]  # a clock that stepped back: counted in the newest bucket
        share = cached / prompt if prompt else 0.0
        if self.buckets and self.buckets[-1][0] == i:
            b = self.buckets[-1]
            b[1], b[2], b[3], b[4] = b[1] + 1, b[2] + prompt, b[3] + cached, max(b[4], share)
        else:
            self.buckets.append([i, 1, prompt, cached, share])
        while self.buckets and self.buckets[0][0] <= i - self.span:
            self.buckets.popleft()

    def _window(self, now: float, seconds: float, skip_s: float) -> tuple[int, int, int, float]:
        """(requests, prompt tokens, cached tokens, best share) of the buckets in (now - skip - seconds, now -
        skip]. Only the newest bucket changes: the sums of the older ones are kept until a new bucket starts, so a
        request reads a window in constant time."""
        hi = int((now - skip_s) // self.bucket_s)
        lo = hi - int(round(seconds / self.bucket_s))
        newest = self.buckets[-1] if self.buckets else None
        key = (lo, hi, newest[0] if newest else None)
        frozen = self._frozen.get(key)
        if frozen is None:
            n = p = c = 0
            best = 0.0
            for b in reversed(self.buckets):  # newest first
                if b[0] <= lo:
                    break
                if b[0] <= hi and b is not newest:
                    n, p, c, best = n + b[1], p + b[2], c + b[3], max(best, b[4])
            if len(self._frozen) > 32:
                self._frozen.clear()
            frozen = self._frozen[key] = (n, p, c, best)
        n, p, c, best = frozen
        if newest is not None and lo < newest[0] <= hi:
            n, p, c, best = n + newest[1], p + newest[2], c + newest[3], max(best, newest[4])
        return n, p, c, best

    def totals(self, now: float, seconds: float, skip_s: float = 0.0) -> tuple[int, int, int]:
        """(requests, prompt tokens, cached tokens) of the buckets in (now - skip - seconds, now - skip]."""
        return self._window(now, seconds, skip_s)[:3]

    def best(self, now: float, seconds: float, skip_s: float = 0.0) -> float:
        """The highest cache-read share of a single request in that window."""
        return self._window(now, seconds, skip_s)[3]

    def share(self, now: float, seconds: float, skip_s: float = 0.0) -> float:
        _, p, c = self.totals(now, seconds, skip_s)
        return c / p if p else 0.0


@dataclass(frozen=True)
class Alert:
    """A hit-rate drop: when, the shares before and after, and where prompts stopped matching."""

    tenant: str
    time: float  # seconds since the epoch
    share_before: float  # cache-read share over the baseline window
    share_now: float  # ... over the last window
    block: int  # the first block where the current prompt differs from the last one that hit well
    token: int  # the first token that differs (block = token // block_size)
    window_s: float = 60.0
    baseline_s: float = 300.0

    def public(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) and k != "time" else v for k, v in asdict(self).items()}

    def message(self) -> str:
        return (
            f"hit-rate drop: tenant {self.tenant}'s cache-read share fell to {self.share_now:.2f} over the last "
            f"{self.window_s:.0f} s from {self.share_before:.2f} over the {self.baseline_s:.0f} s before; prompts "
            f"stopped matching at block {self.block} (token {self.token}): did a release change the prompt there?"
        )


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:  # whole chunks first: lists compare in C
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DropAlarm:
    """One tenant's hit-rate drop alarm (see the module's doc). It fires when, with a steady baseline (at least
    ``2 * min_requests`` requests and a share of ``min_share`` over the ``baseline_s`` before the last window):
    the share over the last ``window_s`` is below ``drop_ratio`` of the baseline's, and each of the last
    ``streak`` requests read less than ``drop_ratio`` of the best single request of the baseline. The second
    test is what a prefix change does (every request loses its hit) and a run of new conversations does not
    (some still hit fully), so bursts of misses do not fire it."""

    def __init__(
        self,
        tenant: str,
        block_size: int,
        window_s: float = 60.0,
        baseline_s: float = 300.0,
        drop_ratio: float = 0.5,
        min_share: float = 0.2,
        min_requests: int = 5,
        streak: int = 10,
        recover_ratio: float = 0.8,
    ) -> None:
        self.tenant, self.block_size = tenant, block_size
        self.window_s, self.baseline_s = window_s, baseline_s
        self.drop_ratio, self.min_share, self.min_requests = drop_ratio, min_share, min_requests
        self.recover_ratio = recover_ratio
        self.windows = ShareWindows(span_s=max(3600.0, window_s + baseline_s) + 600.0)
        self.recent: deque[float] = deque(maxlen=streak)
        self.active: Alert | None = None
        self.fired = 0
        self._reference: list[int] | None = None  # the last prompt that hit well while the share was steady

    def observe(self, prompt_ids: list[int], cached: int, now: float | None = None) -> Alert | None:
        """Count one request (its prompt and its cached tokens as reported); the alert when this one starts a
        drop, else None."""
        now = time.time() if now is None else now
        prompt = len(prompt_ids)
        share = cached / prompt if prompt else 0.0
        self.windows.add(now, prompt, cached)
        self.recent.append(share)
        base_n, base_p, base_c = self.windows.totals(now, self.baseline_s, skip_s=self.window_s)
        cur_n, cur_p, cur_c = self.windows.totals(now, self.window_s)
        base = base_c / base_p if base_p else 0.0
        cur = cur_c / cur_p if cur_p else 0.0
        best = self.windows.best(now, self.baseline_s, skip_s=self.window_s)
        steady = base_n >= 2 * self.min_requests and base >= self.min_share
        if self.active is not None:
            before = self.active.share_before
            if cur >= self.recover_ratio * before or base <= self.drop_ratio * before:
                self.active = None  # recovered, or the low share is the new baseline: armed again
            return None
        if (
            steady
            and cur_n >= self.min_requests
            and cur < self.drop_ratio * base
            and len(self.recent) == self.recent.maxlen
            and max(self.recent) < self.drop_ratio * best
        ):
            token = common_prefix(self._reference, prompt_ids) if self._reference is not None else 0
            block = token // self.block_size
            self.active = Alert(self.tenant, now, base, cur, block, token, self.window_s, self.baseline_s)
            self.fired += 1
            return self.active
        if share > 0 and share >= self.recover_ratio * best:
            self._reference = prompt_ids
        return None


# Histogram buckets (seconds), as vLLM's for the same figures.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
# Queue, prefill and decode time: vLLM's request latency buckets (those of E2E) with finer ones below 0.3 s, where
# a short request's queueing and prefill fall.
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, *E2E_BUCKETS)


class RequestTiming:
    """A request's times on the gateway: first token, the gaps between tokens (a step that brings k tokens counts
    its gap / k k times), end to end."""

    def __init__(self, start: float) -> None:
        self.start = self.last = start
        self.first: float | None = None
        self.gaps: list[float] = []
        self.end: float | None = None

    def tick(self, now: float, new_tokens: int) -> None:
        if new_tokens <= 0:
            return
        if self.first is None:
            self.first = now
            new_tokens -= 1
        if new_tokens > 0:
            self.gaps += [(now - self.last) / new_tokens] * new_tokens
        self.last = now

    def finish(self, now: float) -> None:
        self.end = now

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start
