"""Steady load on a running `kvgrid serve` for the fault suite: a few client threads per tenant send small
requests back to back through the official SDKs, and every request's outcome is recorded.

Outcomes: ``ok`` (a complete, well-formed answer), ``retryable`` (429 or 503 with ``Retry-After``),
``retry_event`` (a stream that had started ends with an error event saying to retry) and ``lost`` (anything else:
another status, a retryable status without ``Retry-After``, a dropped connection, a timeout, a truncated
stream, a malformed answer). The caller marks time windows (steady, fault, recovery) and summarises them.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import anthropic
import openai

OK, RETRYABLE, RETRY_EVENT, LOST = "ok", "retryable", "retry_event", "lost"
KINDS = ("plain", "prefix", "stream")

# A prefix every tenant repeats (prefix-cache hits): 32 of the ~50 prompt tokens with the chat template.
SHARED_PREFIX = "You answer questions about the harbour ferry. Boats leave every half hour from pier three. "
WORDS = (
    "bike ferry harbour quay lighthouse ticket morning evening helmet deposit cargo island bridge market "
    "tide north south river station coffee bakery"
).split()


@dataclass
class Record:
    tenant: str
    kind: str  # one of KINDS
    start: float  # time.monotonic()
    end: float
    outcome: str
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Load:
    """``threads`` clients per tenant, each sending requests back to back until ``stop()``.

    ``tenants`` maps a tenant name to ``(api, key)`` with api ``"openai"`` (chat completions) or
    ``"anthropic"`` (messages). Each client sends, at random, a plain request with a unique prompt (60%), one
    that repeats the tenant's shared prefix (20%) or a streamed one (20%), all with ``max_tokens`` outputs."""

    def __init__(
        self,
        base_url: str,
        tenants: dict[str, tuple[str, str]],
        threads: int = 2,
        max_tokens: int = 8,
        timeout_s: float = 60.0,
    ) -> None:
        self.base_url, self.tenants = base_url, tenants
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self.records: list[Record] = []
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._in_flight: dict[int, float] = {}  # client index -> start of its current request
        clients = [(t, i) for t in tenants for i in range(threads)]
        self._threads = [
            threading.Thread(target=self._run, args=(n, t), name=f"load-{t}-{i}", daemon=True)
            for n, (t, i) in enumerate(clients)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 30)

    # -- the clients ------------------------------------------------------------------------------------------

    def _run(self, n: int, tenant: str) -> None:
        api, key = self.tenants[tenant]
        rng = random.Random(n)
        if api == "openai":
            client = openai.OpenAI(
                base_url=f"{self.base_url}/{tenant}/v1", api_key=key, max_retries=0, timeout=self.timeout_s
            )
        else:
            client = anthropic.Anthropic(
                base_url=f"{self.base_url}/{tenant}", api_key=key, max_retries=0, timeout=self.timeout_s
            )
        while not self._stop.is_set():
            roll = rng.random()
            kind = "plain" if roll < 0.6 else "prefix" if roll < 0.8 else "stream"
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 10)))
            system = SHARED_PREFIX if kind == "prefix" else f"Note {rng.randrange(10**9)}: {words}."
            user = f"Question {rng.randrange(10**6)}: the {rng.choice(WORDS)}?"
            start = time.monotonic()
            with self._mu:
                self._in_flight[n] = start
            if api == "openai":
                outcome, detail = self._openai(client, system, user, kind == "stream")
            else:
                outcome, detail = self._anthropic(client, system, user, kind == "stream")
            with self._mu:
                self.records.append(Record(tenant, kind, start, time.monotonic(), outcome, detail))
                del self._in_flight[n]
            if outcome != OK:  # back off a little, as a real client would, instead of spinning on errors
                self._stop.wait(0.25)

    def _openai(self, client: openai.OpenAI, system: str, user: str, stream: bool) -> tuple[str, str]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        try:
            if stream:
                finish = None
                for chunk in client.chat.completions.create(
                    model="demo", messages=messages, stream=True, max_tokens=self.max_tokens, temperature=0
                ):
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                if finish not in ("length", "stop"):
                    return LOST, f"stream ended without a finish reason ({finish!r})"
                return OK, ""
            r = client.chat.completions.create(
                model="demo", messages=messages, max_tokens=self.max_tokens, temperature=0
            )
            finish = r.choices[0].finish_reason
            if finish not in ("length", "stop") or not 1 <= r.usage.completion_tokens <= self.max_tokens:
                return LOST, f"malformed answer: {finish!r}, {r.usage}"
            return OK, ""
        except openai.APIStatusError as exc:
            return _status(exc.status_code, exc.response.headers.get("retry-after"), exc.message)
        except openai.APIConnectionError as exc:  # also APITimeoutError
            return LOST, f"{type(exc).__name__}: {exc}"
        except openai.APIError as exc:  # an error event in a stream that had started
            return _stream_error(exc.message)
        except Exception as exc:  # a broken stream, a parse error: never acceptable
            return LOST, f"{type(exc).__name__}: {exc}"

    def _anthropic(self, client: anthropic.Anthropic, system: str, user: str, stream: bool) -> tuple[str, str]:
        # This SDK version has no ``temperature`` argument; the body field is still the API's.
        kw = dict(
            model="demo",
            system=system,
            messages=[{"role": "user", "content": user}],
            max_tokens=self.max_tokens,
            extra_body={"temperature": 0},
        )
        try:
            if stream:
                stop = None
                for event in client.messages.create(stream=True, **kw):
                    if event.type == "message_delta":
                        stop = event.delta.stop_reason
                if stop not in ("max_tokens", "end_turn", "stop_sequence"):
                    return LOST, f"stream ended without a stop reason ({stop!r})"
                return OK, ""
            m = client.messages.create(**kw)
            if (
                m.stop_reason not in ("max_tokens", "end_turn", "stop_sequence")
                or not 1 <= m.usage.output_tokens <= self.max_tokens
            ):
                return LOST, f"malformed answer: {m.stop_reason!r}, {m.usage}"
            return OK, ""
        except anthropic.APIStatusError as exc:
            if exc.status_code == 200:  # the SDK raises an error event of a started stream with the stream's 200
                return _stream_error(exc.message)
            return _status(exc.status_code, exc.response.headers.get("retry-after"), exc.message)
        except anthropic.APIConnectionError as exc:
            return LOST, f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            return LOST, f"{type(exc).__name__}: {exc}"

    # -- reading the records ----------------------------------------------------------------------------------

    def settle(self, t: float, timeout_s: float | None = None) -> None:
        """Wait until every request started before ``t`` has an outcome."""
        deadline = time.monotonic() + (self.timeout_s + 10 if timeout_s is None else timeout_s)
        while time.monotonic() < deadline:
            with self._mu:
                if all(start >= t for start in self._in_flight.values()):
                    return
            time.sleep(0.1)
        raise AssertionError(f"requests started before t={t:.1f} are still running")

    @property
    def clients(self) -> int:
        """Client threads over all tenants: at most this many requests are in flight at once."""
        return len(self._threads)

    def window(self, t0: float, t1: float, tenant: str | None = None) -> list[Record]:
        """Records of requests started in ``[t0, t1)`` (of one tenant, or all)."""
        with self._mu:
            return [r for r in self.records if t0 <= r.start < t1 and tenant in (None, r.tenant)]

    def ok_since(self, t: float, tenant: str) -> int:
        """Completed requests of ``tenant`` that started at or after ``t``."""
        with self._mu:
            return sum(1 for r in self.records if r.tenant == tenant and r.start >= t and r.outcome == OK)


def _status(status: int, retry_after: str | None, message: str) -> tuple[str, str]:
    if status in (429, 503) and retry_after:
        return RETRYABLE, f"{status}: {message}"
    return LOST, f"{status} (Retry-After {retry_after!r}): {message}"


def _stream_error(message: str) -> tuple[str, str]:
    # Only the gateway's event for a group that failed under a started stream (the 503 kind) is retryable; a
    # request that failed alone (500) is not, although its message also says to retry.
    if "failed during the request" in message:
        return RETRY_EVENT, message
    return LOST, f"stream error event without a retry hint: {message}"
