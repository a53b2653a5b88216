"""KV events over Redis Streams: one stream per worker group, read by every router replica with its own cursor.

Each entry carries the publisher's sequence number ``n`` (0, 1, 2, ... from the group's start). A reader that
sees a gap (it started after the stream was trimmed, or fell behind the trim) asks for a snapshot of the
group's current keys instead of trusting a partial history; a new ``n == 0`` means the group restarted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.events import AllCleared, BlockRemoved, BlockStored, KVEvent

STREAM_PREFIX = "kvgrid:events:"


def stream_name(group: str) -> str:
    return STREAM_PREFIX + group


def encode(event: KVEvent, n: int) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        width = len(event.keys[0]) if event.keys else 0
        return {"n": n, "t": "s", "w": width, "k": b"".join(event.keys), "p": event.parent_key or b""}
    if isinstance(event, BlockRemoved):
        width = len(event.keys[0]) if event.keys else 0
        return {"n": n, "t": "r", "w": width, "k": b"".join(event.keys), "p": b""}
    if isinstance(event, AllCleared):
        return {"n": n, "t": "c", "w": 0, "k": b"", "p": b""}
    raise TypeError(f"not a KV event: {event!r}")


def decode(fields: dict[bytes, bytes]) -> tuple[int, KVEvent]:
    n, kind, width = int(fields[b"n"]), fields[b"t"], int(fields[b"w"])
    blob = fields[b"k"]
    keys = [blob[i : i + width] for i in range(0, len(blob), width)] if width else []
    if kind == b"s":
        return n, BlockStored(keys, fields[b"p"] or None)
    if kind == b"r":
        return n, BlockRemoved(keys)
    if kind == b"c":
        return n, AllCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


class RedisStreamSink:
    """An ``EventSink`` for a block pool: appends its events to the group's stream (approximately capped)."""

    def __init__(self, client, group: str, max_len: int = 1_000_000) -> None:
        self.client, self.stream, self.max_len = client, stream_name(group), max_len
        self.n = 0
        # A (re)start begins a new history: drop the old one (trimming, not deleting, so new entry ids stay
        # above every reader's cursor), and tell readers to drop what they knew.
        self.client.xtrim(self.stream, maxlen=0, approximate=False)
        self.publish(AllCleared())

    def publish(self, event: KVEvent) -> None:
        self.client.xadd(self.stream, encode(event, self.n), maxlen=self.max_len, approximate=True)
        self.n += 1


class RedisStreamSubscription:
    """Reads the streams of ``groups`` from the beginning of what Redis holds.

    ``resync(group)`` must return events that rebuild the group's state from nothing (``AllCleared`` then a
    ``BlockStored`` of every key it holds); it is called when the history has a gap. Without it, a gap yields
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
        if not self.cursor:
            return []
        reply = self.client.xread(self.cursor, count=self.max_batch, block=self.block_ms)
        out: list[tuple[str, KVEvent]] = []
        for stream, entries in reply or []:
            stream = stream.decode() if isinstance(stream, bytes) else stream
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
