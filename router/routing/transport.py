"""How KV events reach a ``Router``: a ``Subscription`` it polls for ``(group, event)`` pairs in order. Every router
replica reads with its own cursor, so each keeps a full copy of the index. A live replica reads the groups'
Redis streams (``common.event_stream.RedisStreamSubscription``, or the groups' own event logs over Ray: see
``router.routing.service``); ``InProcessTransport`` is the in-memory log the simulator (``kvgrid replay``) and
tests publish to."""

from __future__ import annotations

from typing import Protocol

from common.events import KVEvent


class Subscription(Protocol):
    def poll(self) -> list[tuple[str, KVEvent]]:
        """Events published since the previous poll, in order."""
        ...


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
