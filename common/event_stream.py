"""KV events over Redis Streams: one stream per worker group, read by every router replica with its own cursor.

Each entry carries the publisher's sequence number ``n`` (0, 1, 2, ... from the group's start). A reader that
sees a gap (it started after the stream was trimmed, or fell behind the trim) asks for a snapshot of the
group's current keys instead of trusting a partial history; a new ``n == 0`` means the group restarted (or its
publisher rewrote its state after losing events). Entries also carry ``h``, an id of the publisher's current
history, which readers may ignore. A ``stored`` or ``removed`` entry names its tier in ``l`` (``gpu``, ``host``,
``disk``); an entry without it (written before tiers existed) is GPU.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from common.events import AllCleared, BlockRemoved, BlockStored, HeldKeys, KVEvent, Tier, snapshot_events

STREAM_PREFIX = "kvgrid:events:"
_TIERS = {t.value.encode(): t for t in Tier}
_log = logging.getLogger(__name__)


def stream_name(group: str) -> str:
    return STREAM_PREFIX + group


def encode(event: KVEvent, n: int) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        width = len(event.keys[0]) if event.keys else 0
        keys, parent = b"".join(event.keys), event.parent_key or b""
        return {"n": n, "t": "s", "w": width, "k": keys, "p": parent, "l": event.tier.value}
    if isinstance(event, BlockRemoved):
        width = len(event.keys[0]) if event.keys else 0
        return {"n": n, "t": "r", "w": width, "k": b"".join(event.keys), "p": b"", "l": event.tier.value}
    if isinstance(event, AllCleared):
        return {"n": n, "t": "c", "w": 0, "k": b"", "p": b""}
    raise TypeError(f"not a KV event: {event!r}")


def decode(fields: dict[bytes, bytes]) -> tuple[int, KVEvent]:
    n, kind, width = int(fields[b"n"]), fields[b"t"], int(fields[b"w"])
    blob = fields[b"k"]
    keys = [blob[i : i + width] for i in range(0, len(blob), width)] if width else []
    if kind in (b"s", b"r"):
        tier = _TIERS.get(fields.get(b"l", b"gpu"))
        if tier is None:
            raise ValueError(f"unknown KV cache tier {fields[b'l']!r}")
        return n, BlockStored(keys, fields[b"p"] or None, tier) if kind == b"s" else BlockRemoved(keys, tier)
    if kind == b"c":
        return n, AllCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def stream_client(url: str, timeout_s: float = 2.0):
    """A Redis client for a ``RedisStreamSink``: short socket timeouts and no retries of its own (the sink's
    writer retries with backoff), so a paused or unreachable Redis is noticed quickly."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


class RedisStreamSink:
    """An ``EventSink`` for a block pool that never makes its publisher wait on Redis.

    ``publish`` only appends to a bounded in-memory buffer; a daemon thread writes the buffer to the group's
    stream (approximately capped at ``max_len``) in pipelined batches, retrying with backoff while Redis is
    unreachable, so the engine keeps stepping at full speed through a Redis outage and the events follow once
    Redis answers again. A new sink (a group's start) begins a new history: the writer first trims the stream
    (trimming, not deleting, so new entry ids stay above every reader's cursor) and writes ``AllCleared`` as
    ``n == 0``. Each entry also carries ``h``, an id of its history, which lets the writer tell after an
    outage whether its last batch landed and whether Redis still holds its history.

    If more than ``max_buffer`` events pile up (a long outage), the buffer is dropped. With ``snapshot`` (returns
    every key the pool holds, or the keys of each tier: ``HeldKeys``; the caller makes it safe to call from the
    writer thread, e.g. by taking the engine's lock) the writer then starts a new history, ``AllCleared`` and
    ``BlockStored`` of the snapshot (per tier: ``snapshot_events``),
    followed by the events published since the snapshot began (re-applying those is harmless: events set keys
    present or absent). It does the same when Redis comes back without the history (restarted empty). Without
    ``snapshot`` the dropped events leave a gap in ``n``, which makes readers resynchronise from the group.

    Give it a client with short socket timeouts (``stream_client``)."""

    def __init__(
        self,
        client,
        group: str,
        max_len: int = 1_000_000,
        snapshot: Callable[[], HeldKeys] | None = None,
        max_buffer: int = 100_000,
        batch: int = 256,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.client, self.stream, self.max_len = client, stream_name(group), max_len
        self.snapshot, self.max_buffer, self.batch, self.max_backoff_s = snapshot, max_buffer, batch, max_backoff_s
        self.dropped = 0  # events dropped on overflow (for operators)
        self._cond = threading.Condition()
        self._buf: deque[KVEvent] = deque()
        self._gen = 0  # bumped whenever the buffer is replaced: a batch taken from an older one is stale
        self._n = 0  # the sequence number of _buf[0]
        self._history = ""
        self._trim_pending = False
        self._resync = False  # the buffer overflowed: write a snapshot next
        self._written: tuple[str, int] | None = None  # (history, n) of the last entry known to be in the stream
        self._closed = False
        self._new_history()
        self._buf.append(AllCleared())
        self._thread = threading.Thread(target=self._run, name=f"kvgrid-events-{group}", daemon=True)
        self._thread.start()

    def publish(self, event: KVEvent) -> None:
        with self._cond:
            if self._resync:
                self.dropped += 1
                return  # the snapshot the writer will take covers it
            if len(self._buf) >= self.max_buffer:
                self.dropped += len(self._buf) + 1
                self._n += len(self._buf)  # without a snapshot, readers see the gap and resync
                self._buf.clear()
                self._gen += 1
                if self.snapshot is not None:
                    self._resync = True
                    self._cond.notify_all()
                    return
            self._buf.append(event)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event published so far is in Redis; False if that took longer than ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._buf and not self._resync, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is buffered (for at most ``timeout`` seconds) and stop the writer."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _new_history(self) -> None:
        """Called with the lock held: the next write trims the stream and numbers entries from 0."""
        self._history, self._n, self._trim_pending = os.urandom(8).hex(), 0, True

    def _run(self) -> None:
        delay, healthy, attempted = 0.0, True, None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._buf or self._resync or self._closed)
                if self._closed:
                    return
                gen, n0, history, trim, resync = self._gen, self._n, self._history, self._trim_pending, self._resync
                items = list(itertools.islice(self._buf, self.batch))
            try:
                if not healthy:
                    self.client.ping()
                    _log.warning("kvgrid events: %s reachable again", self.stream)
                    last = self._last_entry()
                    if attempted is not None and attempted[0] == gen and last == attempted[2]:
                        self._done(gen, attempted[1], trim, last)  # the batch that timed out had landed
                        healthy, delay, attempted = True, 0.0, None
                        continue
                    if not trim and last != self._written and self.snapshot is not None:
                        resync = True  # Redis lost our history (restarted empty, or the stream was deleted)
                    healthy = True
                if resync:
                    self._write_snapshot()
                    continue
                attempted = (gen, len(items), (history, n0 + len(items) - 1))
                self._write(trim, history, n0, items)
            except Exception as exc:  # Redis unreachable or slow (or the snapshot failed): retry with backoff
                if healthy:
                    _log.warning(
                        "kvgrid events: writing %s failed (%s: %s); buffering and retrying",
                        self.stream,
                        type(exc).__name__,
                        exc,
                    )
                healthy = False
                delay = min(self.max_backoff_s, max(0.05, delay * 2))
                with self._cond:
                    if self._cond.wait_for(lambda: self._closed, delay):
                        return
                continue
            self._done(gen, len(items), trim, attempted[2])
            delay, attempted = 0.0, None

    def _last_entry(self) -> tuple[str, int] | None:
        entries = self.client.xrevrange(self.stream, count=1)
        if not entries:
            return None
        fields = entries[0][1]
        return fields.get(b"h", b"").decode(), int(fields[b"n"])

    def _write(self, trim: bool, history: str, n0: int, items: list[KVEvent]) -> None:
        pipe = self.client.pipeline(transaction=True)  # all or nothing: a retry never duplicates half a batch
        if trim:
            pipe.xtrim(self.stream, maxlen=0, approximate=False)
        for i, event in enumerate(items):
            fields = encode(event, n0 + i)
            fields["h"] = history
            pipe.xadd(self.stream, fields, maxlen=self.max_len, approximate=True)
        pipe.execute()

    def _done(self, gen: int, count: int, trim: bool, last: tuple[str, int]) -> None:
        """``count`` events from the head of the buffer are in the stream, ending with entry ``last``."""
        with self._cond:
            if self._gen == gen:
                for _ in range(count):
                    self._buf.popleft()
                self._n += count
                if trim:
                    self._trim_pending = False
                self._written = last
            self._cond.notify_all()

    def _write_snapshot(self) -> None:
        """Replace the buffer with a new history: ``AllCleared``, the pool's keys, then what follows them."""
        assert self.snapshot is not None
        with self._cond:
            self._gen += 1
            self._buf.clear()
            self._resync = False
            gen = self._gen
        try:
            held = self.snapshot()  # events published from here on stay in the buffer, after the snapshot
        except Exception:
            with self._cond:
                self._resync = True
            raise
        events = snapshot_events(held)
        with self._cond:
            if self._gen != gen:
                return  # overflowed again meanwhile: the next snapshot replaces this one
            self._buf.extendleft(reversed(events))
            self._new_history()
            self._cond.notify_all()


class RedisStreamSubscription:
    """Reads the streams of ``groups`` from the beginning of what Redis holds.

    ``resync(group)`` must return events that rebuild the group's state from nothing (``AllCleared`` then a
    ``BlockStored`` of every key it holds, per tier: ``common.events.snapshot_events``); it is called when the
    history has a gap. Without it, a gap yields
    ``AllCleared`` and the group lands in ``needs_resync`` for the caller to fetch a snapshot itself."""

    def __init__(
        self,
        client,
        groups: list[str],
        resync: Callable[[str], list[KVEvent]] | None = None,
        block_ms: int | None = None,
        max_batch: int = 10_000,
    ) -> None:
        self.client, self.resync, self.block_ms, self.max_batch = client, resync, block_ms, max_batch
        self.cursor = {stream_name(g): "0-0" for g in groups}
        self.next_n: dict[str, int | None] = {g: None for g in groups}
        self.needs_resync: set[str] = set()

    def add_group(self, group: str) -> None:
        self.cursor.setdefault(stream_name(group), "0-0")
        self.next_n.setdefault(group, None)

    def remove_group(self, group: str) -> None:
        self.cursor.pop(stream_name(group), None)
        self.next_n.pop(group, None)

    def poll(self) -> list[tuple[str, KVEvent]]:
        streams = dict(self.cursor)
        return self.consume(streams, self.read(streams))

    def read(self, streams: dict[str, str], block_ms: int | None = None):
        """Redis's reply for ``streams`` (a copy of ``cursor``): the only network call of a poll, so a caller
        may run it in another thread and hand the reply to ``consume`` on its own. ``block_ms``: wait up to that
        long for a first new entry (default: the subscription's ``block_ms``; None there: answer at once)."""
        if not streams:
            return []
        block = self.block_ms if block_ms is None else block_ms
        return self.client.xread(streams, count=self.max_batch, block=block)

    def consume(self, streams: dict[str, str], reply) -> list[tuple[str, KVEvent]]:
        """The events of a ``read(streams)`` reply, advancing the cursors. A stream whose cursor changed since
        the read (its group was removed or added again) is skipped: the next read fetches it afresh."""
        out: list[tuple[str, KVEvent]] = []
        for stream, entries in reply or []:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            if self.cursor.get(stream) != streams.get(stream):
                continue
            group = stream[len(STREAM_PREFIX) :]
            for entry_id, fields in entries:
                self.cursor[stream] = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                n, event = decode(fields)
                expected = self.next_n.get(group)
                if n != 0 and n != expected:
                    # History starts mid-way (trimmed) or skipped entries: rebuild from a snapshot.
                    if self.resync is not None:
                        out.extend((group, e) for e in self.resync(group))
                    else:
                        out.append((group, AllCleared()))
                        self.needs_resync.add(group)
                else:
                    out.append((group, event))
                self.next_n[group] = n + 1
        return out


class TeeSink:
    """Publishes every event to several sinks (a group's own log and its Redis stream)."""

    def __init__(self, *sinks) -> None:
        self.sinks = sinks

    def publish(self, event: KVEvent) -> None:
        for s in self.sinks:
            s.publish(event)
