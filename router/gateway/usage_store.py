"""The usage ledger: each tenant's counters (requests, tokens, cache writes and reads, storage, cost), buffered in
the process and added to Redis in the background, so a request never waits on Redis to be counted."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping
from typing import TypeVar

import redis
import redis.asyncio

from router.gateway.store_base import StoreUnavailable, _bounded, _timeout_of

log = logging.getLogger(__name__)

T = TypeVar("T")

USAGE_FIELDS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "cache_write_tokens",
    "cache_read_tokens",
    # Writes by the TTL they were priced at, and the token-seconds of storage those writes were billed for.
    "cache_write_5m_tokens",
    "cache_write_1h_tokens",
    "storage_token_seconds",
    # Money in pico-dollars (router/gateway/economics.py): what the traffic cost, and would have without the cache.
    # In Redis each of these carries whole dollars into a field of its own (``cost_usd``...), so no counter
    # overflows; every reader gets the sum back in pico-dollars.
    "cost_pusd",
    "uncached_cost_pusd",
)
_PICO = 10**12


_APPLY_USAGE = """
local done = tonumber(redis.call('GET', KEYS[1]) or '0')
local seq = tonumber(ARGV[1])
if done >= seq then return 0 end
for i = 2, #KEYS do
  local field = ARGV[2 * i - 2]
  local v = redis.call('HINCRBY', KEYS[i], field, ARGV[2 * i - 1])
  if string.sub(field, -5) == '_pusd' and v >= 1e12 then  -- carry whole dollars: the field stays small
    local carry = math.floor(v / 1e12)
    redis.call('HINCRBY', KEYS[i], string.sub(field, 1, -6) .. '_usd', string.format('%.0f', carry))
    redis.call('HINCRBY', KEYS[i], field, string.format('%.0f', -carry * 1e12))
  end
end
redis.call('SET', KEYS[1], seq, 'EX', 86400)
return 1
"""


class UsageLedger:
    """Per-tenant token counters (Redis hashes ``kvgrid:usage:{tenant}``), durable across restarts.

    ``record`` only adds to a buffer in this process; a background task writes the buffer to Redis every
    ``flush_interval_s`` in one atomic script. While Redis is down the buffer is kept and retried, so nothing
    recorded is lost as long as the process lives; each batch carries a sequence number, so one that reached
    Redis but whose reply did not is never counted twice."""

    def __init__(self, client: redis.asyncio.Redis, flush_interval_s: float = 0.2) -> None:
        self.r = client
        self.interval_s = flush_interval_s
        self.deadline_s = 2 * _timeout_of(client)
        self._id = secrets.token_hex(8)  # this ledger's sequence numbers are its own
        self._seq = 0
        self._pending: dict[str, dict[str, int]] = {}
        self._sending: tuple[int, dict[str, dict[str, int]]] | None = None  # sent, not yet acknowledged
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._apply = client.register_script(_APPLY_USAGE)

    def record(self, tenant: str, **counts: int) -> None:
        """Add ``counts`` (fields of ``USAGE_FIELDS``) to ``tenant``'s totals. Never blocks, never touches
        Redis; a ValueError only for an unknown field (a bug in the caller)."""
        unknown = set(counts) - set(USAGE_FIELDS)
        if unknown:
            raise ValueError(f"unknown usage fields {sorted(unknown)}")
        mine = self._pending.setdefault(tenant, {})
        for field, n in counts.items():
            if n:
                mine[field] = mine.get(field, 0) + int(n)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop here: whoever owns the ledger calls flush()
            return
        self.start()

    def start(self) -> None:
        """Start the background flusher in the running event loop (``record`` does it on first use)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._stop = asyncio.Event()  # of this loop, unset
            self._task = loop.create_task(self._flush_forever(), name="kvgrid-usage-flush")

    async def _flush_forever(self) -> None:
        failing = False  # log when writing stops and starts working again, not every round in between
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
                return  # close(): it writes the rest
            except TimeoutError:
                pass
            try:
                await self.flush()
            except StoreUnavailable as exc:  # kept in the buffer; the next round tries again
                if not failing:
                    log.warning("usage ledger: %s; buffering usage until Redis is back", exc)
                failing = True
                continue
            if failing:
                log.warning("usage ledger: Redis is back; buffered usage written")
            failing = False

    async def flush(self) -> None:
        """Write what was recorded before this call to Redis; StoreUnavailable (and the counts kept) if Redis
        fails."""
        await _bounded(self.deadline_s, self._write())

    async def _write(self) -> None:
        # At most two rounds: the batch already in flight (if any), then what was pending at the call.
        for _ in range(2):
            if self._sending is None:
                if not self._pending:
                    return
                self._seq += 1
                self._sending, self._pending = (self._seq, self._pending), {}
            batch = self._sending
            seq, counts = batch
            keys = [self._seq_key]
            args: list[str | int] = [seq]
            for tenant, fields in counts.items():
                for field, n in fields.items():
                    keys.append(f"kvgrid:usage:{tenant}")
                    args += [field, n]
            await self._apply(keys=keys, args=args)
            if self._sending is batch:  # another flush may have sent it meanwhile (a no-op in Redis)
                self._sending = None

    @property
    def _seq_key(self) -> str:
        return f"kvgrid:usage-seq:{self._id}"

    async def totals(self, tenant: str) -> dict[str, int]:
        """``tenant``'s counters, including what is still buffered here."""
        # What is buffered now, and the sequence numbers it will reach Redis under: Redis's applied sequence
        # number (read atomically with the counters) tells which of it the counters hold already.
        sending, pending, pending_seq = self._sending, dict(self._pending.get(tenant, {})), self._seq + 1

        async def read():
            async with self.r.pipeline(transaction=True) as pipe:
                return await pipe.hgetall(f"kvgrid:usage:{tenant}").get(self._seq_key).execute()

        raw, done = await _bounded(self.deadline_s, read())
        done = int(done or 0)
        out = _usage_of(raw)
        buffered = [(pending_seq, pending)]
        if sending is not None:
            buffered.append((sending[0], sending[1].get(tenant, {})))
        for seq, counts in buffered:
            if done < seq:  # not in Redis's counters yet
                for f, n in counts.items():
                    out[f] += n
        return out

    async def close(self) -> None:
        """Stop the background flusher and write what is buffered (StoreUnavailable if Redis is down: those
        counts are lost with the process)."""
        task, self._task = self._task, None
        if task is not None:  # stopped between rounds, never cancelled inside a Redis call (which can hang it)
            self._stop.set()
            await asyncio.wait({task}, timeout=2 * self.deadline_s)
            if not task.done():
                task.cancel()
        await self.flush()


def read_usage(client: redis.Redis, tenant: str) -> dict[str, int]:
    """``tenant``'s counters as Redis holds them, with a synchronous client (tools and tests; a gateway's
    ledger may still buffer a fraction of a second of usage)."""
    return _usage_of(client.hgetall(f"kvgrid:usage:{tenant}"))


def _usage_of(raw: Mapping) -> dict[str, int]:
    """The counters of a Redis usage hash; money in pico-dollars (the carried whole dollars added back)."""
    out = {f: int(raw.get(f.encode(), 0)) for f in USAGE_FIELDS}
    for f in USAGE_FIELDS:
        if f.endswith("_pusd"):
            out[f] += int(raw.get(f.removesuffix("_pusd").encode() + b"_usd", 0)) * _PICO
    return out
