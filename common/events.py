"""KV events: what a worker group tells the router about the blocks it holds."""

from __future__ import annotations

from typing import NamedTuple, Protocol


class BlockStored(NamedTuple):
    """Full blocks with these chained keys now hold valid K/V; ``parent_key`` precedes ``keys[0]``."""

    keys: list[bytes]
    parent_key: bytes | None


class BlockRemoved(NamedTuple):
    """These keys were evicted: their blocks now hold something else."""

    keys: list[bytes]


class AllCleared(NamedTuple):
    """Every cached block was dropped (cache reset or restart)."""


KVEvent = BlockStored | BlockRemoved | AllCleared


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
