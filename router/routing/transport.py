"""How KV events reach the routers. A transport is an append-only log of ``(group, event)``; every router
replica reads it with its own cursor, so each keeps a full copy of the index. In-process here; the gateway
issue adds Redis Streams with the same shape."""

from __future__ import annotations

from typing import Protocol

from common.events import KVEvent


class Subscription(Protocol):
    def poll(self) -> list[tuple[str, KVEvent]]:
        """Events published since the previous poll, in order."""
        ...


class EventTransport(Protocol):
    def publish(self, group: str, events: list[KVEvent]) -> None: ...

    def subscribe(self) -> Subscription: ...


class InProcessTransport:
    """A list and a cursor per subscriber. Trims what every subscriber has read."""

    def __init__(self) -> None:
        self._log: list[tuple[str, KVEvent]] = []
        self._base = 0  # absolute offset of _log[0]
        self._subs: list[_InProcessSubscription] = []

    def publish(self, group: str, events: list[KVEvent]) -> None:
        self._log.extend((group, e) for e in events)

    def subscribe(self) -> _InProcessSubscription:
        sub = _InProcessSubscription(self, self._base + len(self._log))
        self._subs.append(sub)
        return sub

    def _read(self, offset: int) -> tuple[list[tuple[str, KVEvent]], int]:
        out = self._log[offset - self._base :]
        end = self._base + len(self._log)
        low = min(s.offset for s in self._subs) if self._subs else end
        if low - self._base > 4096:
            del self._log[: low - self._base]
            self._base = low
        return out, end


class _InProcessSubscription:
    def __init__(self, transport: InProcessTransport, offset: int) -> None:
        self.transport, self.offset = transport, offset

    def poll(self) -> list[tuple[str, KVEvent]]:
        events, self.offset = self.transport._read(self.offset)
        return events
