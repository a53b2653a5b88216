"""KV events: what a worker group tells the router about the blocks it holds."""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from typing import NamedTuple, Protocol


class Tier(enum.StrEnum):
    """Where a group holds a block: its GPU (or CPU engine) KV pool, host RAM, or local disk. The tiers are
    independent: a block may be held in several at once (a block loaded back from host RAM stays there)."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"


class BlockStored(NamedTuple):
    """Full blocks with these chained keys are now held in ``tier``; ``parent_key`` precedes ``keys[0]``."""

    keys: list[bytes]
    parent_key: bytes | None
    tier: Tier = Tier.GPU


class BlockRemoved(NamedTuple):
    """``tier`` no longer holds these keys (evicted: in the GPU pool their blocks now hold something else)."""

    keys: list[bytes]
    tier: Tier = Tier.GPU


class AllCleared(NamedTuple):
    """Every cached block of every tier was dropped (cache reset or restart); a group whose disk tier survived
    a restart then publishes ``BlockStored(..., tier=DISK)`` of what it still holds."""


KVEvent = BlockStored | BlockRemoved | AllCleared

# What a group holds, for a snapshot: every key of its GPU pool, or the keys of each tier.
HeldKeys = list[bytes] | Mapping[Tier, list[bytes]]
SNAPSHOT_CHUNK = 10_000  # keys per BlockStored event of a snapshot


def snapshot_events(held: HeldKeys) -> list[KVEvent]:
    """The events that rebuild a reader's view of a group from nothing: ``AllCleared``, then ``BlockStored`` of
    every key it holds, tier by tier (GPU first), in chunks of ``SNAPSHOT_CHUNK`` keys."""
    by_tier = {Tier.GPU: held} if isinstance(held, list) else held
    out: list[KVEvent] = [AllCleared()]
    for tier in Tier:
        keys = list(by_tier.get(tier, ()))
        out.extend(BlockStored(keys[i : i + SNAPSHOT_CHUNK], None, tier) for i in range(0, len(keys), SNAPSHOT_CHUNK))
    return out


class EventSink(Protocol):
    """Where a block pool publishes its events (in-process list, Redis stream, ...)."""

    def publish(self, event: KVEvent) -> None: ...


class ListSink:
    """Collects events in memory: for tests and for actors that batch events per step."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def publish(self, event: KVEvent) -> None:
        self.events.append(event)

    def drain(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out


class EventLog:
    """A bounded log with absolute offsets: any number of readers follow it with their own cursor, from other
    threads than the publisher's.

    A reader whose cursor is not in the log any more (trimmed, or from before a restart) gets ``None`` from
    ``read`` and must resynchronise from a snapshot (the publisher's current keys)."""

    def __init__(self, max_events: int = 100_000) -> None:
        self.max_events = max_events
        self._events: list[KVEvent] = []
        self._base = 0
        self._lock = threading.Lock()

    def publish(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)
            if len(self._events) > 2 * self.max_events:
                drop = len(self._events) - self.max_events
                del self._events[:drop]
                self._base += drop

    def read(self, offset: int) -> tuple[list[KVEvent] | None, int]:
        """Events from ``offset`` to the end (None if the cursor is not in the log) and the end offset."""
        with self._lock:
            end = self._base + len(self._events)
            if not self._base <= offset <= end:
                return None, end
            return self._events[offset - self._base :], end
