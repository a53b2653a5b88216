"""Connection hygiene at a gateway replica's HTTP server: what a socket may cost before it is a request.

uvicorn counts open *connections* toward ``limit_concurrency`` and answers 503 past it, so about a thousand TCP
connections that send nothing (no key needed) turned every tenant's requests away for as long as they stayed open.
Here the HTTP protocol of every connection (uvicorn's httptools one, subclassed) keeps to deadlines of its own, and a
guard shared by the connections of one server caps how many there are:

- a new connection must start its first request within ``idle_timeout_s`` (stray bytes such as empty lines do not
  extend it); between requests a keep-alive connection has ``keep_alive_s``;
- a request's head (request line and headers) must arrive within ``header_timeout_s`` of its first byte, and be at
  most ``MAX_HEAD_BYTES`` (slowloris clients that trickle header lines get a 408, then the connection is closed);
- a request body may stall at most ``body_timeout_s``, and past that grace it must keep up ``body_min_rate`` bytes
  per second on average (the rule of Apache's mod_reqtimeout: the deadline is the grace plus one second per
  ``body_min_rate`` bytes received). Time in which the server is not reading (the app has not asked for the body
  yet, or the client waits for ``100 Continue``) does not count;
- one client address (IPv4, or an IPv6 /64) may hold ``max_connections_per_client`` connections, the server
  ``max_connections`` (by default sized from the process's file-descriptor limit, which ``raise_fd_limit`` raises to
  its hard limit). A connection over the per-client cap gets a 503 with ``Retry-After`` and is closed without reading
  anything; at the server's cap the oldest connection that has not yet sent a complete request head is closed to
  make room (one that has, and its requests, are never closed for a newcomer), and only when there is none is the
  newcomer refused the same way.

Admission of requests is no longer by sockets: ``http.max_ongoing_requests`` caps the requests admitted whose
response has not completed (503 with ``Retry-After`` past it; uvicorn's ``limit_concurrency``, which counted
connections, is off). A request without a valid key is answered 401 before its body is read, so it holds a place
no longer than that; tenants have their own ``limits.max_inflight_requests`` per replica (core.py
``Admission.held``)."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.config import HttpConfig
from router.gateway.access import AccessLog

log = logging.getLogger(__name__)

# The most bytes of one request head (request line and headers) or of stray bytes before it (nginx allows 4 x 8 KiB
# of headers, Node 16 KiB); past it: 431 and the connection is closed.
MAX_HEAD_BYTES = 64 * 2**10
# max_connections from the fd limit: the soft limit less the fds open at start, less this reserve (Redis and Ray
# connections, files), and at most DERIVED_MAX_CONNECTIONS (an idle connection costs a few KiB of memory).
FD_RESERVE_MIN = 256
FD_RESERVE_FRACTION = 0.125
DERIVED_MAX_CONNECTIONS = 65_536
RETRY_AFTER_S = 1
LOG_EVERY_S = 10.0  # a warning about refused or cut-off connections at most this often, per kind

_REFUSED_BODY = b"too many connections; retry later"
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nretry-after: %d\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (RETRY_AFTER_S, len(_REFUSED_BODY), _REFUSED_BODY)
)
_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"

# A connection's phase, each with its deadline (BUSY has none: the app has the whole request).
_NEW, _IDLE, _HEAD, _BODY, _BUSY = range(5)


_HTTP_DEFAULTS = HttpConfig()  # the policy's defaults are the config's: defined once, in HttpConfig


@dataclass(frozen=True)
class ConnectionPolicy:
    """The connection limits of one HTTP server (``HttpConfig``'s; see there and docs/operations.md)."""

    idle_timeout_s: float = _HTTP_DEFAULTS.idle_timeout_s
    header_timeout_s: float = _HTTP_DEFAULTS.header_timeout_s
    body_timeout_s: float = _HTTP_DEFAULTS.body_timeout_s
    body_min_rate: int = _HTTP_DEFAULTS.body_min_rate
    max_connections_per_client: int = _HTTP_DEFAULTS.max_connections_per_client  # 0: no cap
    max_connections: int = _HTTP_DEFAULTS.max_connections  # 0: from the file-descriptor limit

    @classmethod
    def from_config(cls, http: HttpConfig) -> ConnectionPolicy:
        return cls(**{f.name: getattr(http, f.name) for f in fields(cls)})


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit where it is lower; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 2**20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:  # e.g. above the kernel's nr_open
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft


def _open_fds() -> int:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def connection_cap(configured: int, fd_limit: int | None = None) -> int:
    """The connections one server may hold: ``configured`` (0: as many as the fd limit leaves room for, less a
    reserve), never more than the fd limit leaves room for."""
    limit = raise_fd_limit() if fd_limit is None else fd_limit
    if limit == resource.RLIM_INFINITY:
        limit = 2**20
    room = limit - _open_fds() - max(FD_RESERVE_MIN, int(limit * FD_RESERVE_FRACTION))
    room = max(16, room)
    if configured <= 0:
        return min(room, DERIVED_MAX_CONNECTIONS)
    if configured > room:
        log.warning(
            "http.max_connections is %d, but the open-file limit (%d) leaves room for %d: using %d",
            configured,
            limit,
            room,
            room,
        )
        return room
    return configured


def client_key(peer: Any) -> str:
    """The address a per-client cap counts by: the IPv4 address, or the /64 of an IPv6 one (a host usually has a
    whole /64)."""
    if not isinstance(peer, tuple) or not peer:
        return ""
    host = str(peer[0])
    if ":" not in host:
        return host
    import ipaddress

    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return f"{ipaddress.IPv6Network((ip, 64), strict=False).network_address}/64"


class ConnectionGuard:
    """The connections of one server: counts per client address and in all, the ones that have not sent a
    complete request head yet (oldest first: the ones closed to make room), and what was refused or cut off."""

    def __init__(self, policy: ConnectionPolicy, max_connections: int, max_ongoing_requests: int) -> None:
        self.policy, self.max_connections, self.max_ongoing_requests = policy, max_connections, max_ongoing_requests
        self.total = 0
        self.ongoing = 0  # requests admitted whose response is not complete (one per connection at most)
        self.per_client: dict[str, int] = {}
        self.pending: dict[GuardedHttpProtocol, None] = {}  # insertion order: oldest first
        self.stats: Counter[str] = Counter()
        self._logged: dict[str, float] = {}

    def note(self, kind: str, client: str, warn: bool = True) -> None:
        """Count an event (``refused_client``, ``refused_full``, ``evicted``, ``idle_timeout``, ``header_timeout``,
        ``body_timeout``, ``head_too_large``, ``busy``, ``keep_alive_timeout``), and, with ``warn``, say so in the
        log now and then."""
        self.stats[kind] += 1
        if not warn:
            return
        now = time.monotonic()
        if now - self._logged.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[kind] = now
            log.warning(
                "http ingress: %s (%d so far; last from %s; %d connections open)",
                kind,
                self.stats[kind],
                client or "?",
                self.total,
            )

    def admit(self, conn: GuardedHttpProtocol, key: str) -> bool:
        cap = self.policy.max_connections_per_client
        if cap > 0 and self.per_client.get(key, 0) >= cap:
            self.note("refused_client", key)
            return False
        if self.total >= self.max_connections:
            if not self.pending:
                self.note("refused_full", key)
                return False
            oldest = next(iter(self.pending))
            self.release(oldest)
            oldest.evict()
            self.note("evicted", oldest.client_key)
        self.total += 1
        self.per_client[key] = self.per_client.get(key, 0) + 1
        self.pending[conn] = None
        conn.counted = True
        return True

    def settled(self, conn: GuardedHttpProtocol) -> None:
        """``conn`` sent a complete request head: never closed to make room for another."""
        self.pending.pop(conn, None)

    def release(self, conn: GuardedHttpProtocol) -> None:
        if not conn.counted:
            return
        conn.counted = False
        self.pending.pop(conn, None)
        self.total -= 1
        left = self.per_client[conn.client_key] - 1
        if left:
            self.per_client[conn.client_key] = left
        else:
            del self.per_client[conn.client_key]


def quiet_disconnects(app: Any) -> Any:
    """``app``, but a client that went away while its body was read (or a body cut off here) ends the request
    quietly: Starlette raises ``ClientDisconnect``, which uvicorn would log with a traceback per connection."""

    async def quiet(scope: Any, receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        except ClientDisconnect:
            pass  # nothing to answer: the connection is gone

    return quiet


async def _busy_answer(scope: Any, receive: Any, send: Any) -> None:
    """The answer past ``http.max_ongoing_requests``."""
    body = b"this gateway replica is at http.max_ongoing_requests; retry"
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


_busy = AccessLog(_busy_answer)  # with its X-Request-Id and access log line, like every other answer


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the deadlines and caps of the module docstring. ``guard`` is set on a
    subclass per server (``protocol_for``)."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # requests are admitted by http.max_ongoing_requests, sockets by the guard
        self.counted = False
        self.refused = False
        self._working = False  # a request of this connection is admitted and its response not complete
        self.client_key = ""
        self._phase = _NEW
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._body_start = self._body_last = 0.0
        self._body_bytes = 0

    # Connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.client_key = client_key(transport.get_extra_info("peername"))
        if not self.guard.admit(self, self.client_key):
            self.refused = True
            self.transport = transport
            transport.write(_REFUSED)
            transport.close()
            return
        super().connection_made(transport)
        self._set_phase(_NEW, self.guard.policy.idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self.refused:
            return
        self._done_working()
        self.guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self._phase <= _HEAD:  # _NEW, _IDLE, _HEAD: bytes of a request head, or stray bytes before one
            self._head_bytes += len(data)
        super().data_received(data)
        if self._phase <= _HEAD and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._cut("head_too_large", _TOO_LARGE)

    def evict(self) -> None:
        """Closed to make room for a new connection (the guard no longer counts it)."""
        self._cancel_timer()
        if not self.transport.is_closing():
            self.transport.close()

    # Parser callbacks (httptools)
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._set_phase(_HEAD, self.guard.policy.header_timeout_s)

    def on_headers_complete(self) -> None:
        self.guard.settled(self)
        now = self.loop.time()
        self._head_bytes, self._body_start, self._body_last, self._body_bytes = 0, now, now, 0
        self._set_phase(_BODY, self.guard.policy.body_timeout_s)
        if self._working:  # pipelined behind a request of this connection: counted with it
            super().on_headers_complete()
            return
        if self.guard.ongoing < self.guard.max_ongoing_requests:
            self._working = True
            self.guard.ongoing += 1
            super().on_headers_complete()
            return
        self.guard.note("busy", self.client_key)
        app, self.app = self.app, _busy
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        self._body_last = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = _BUSY
        self._cancel_timer()
        self._idle_if_done()  # the response may have gone out before the body came in (a 401)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.pipeline:
            self._done_working()
            if self._phase == _BUSY:
                self._idle_if_done()

    def _done_working(self) -> None:
        if self._working:
            self._working = False
            self.guard.ongoing -= 1

    # Deadlines
    def _idle_if_done(self) -> None:
        if self.cycle is not None and self.cycle.response_complete and not self.pipeline:
            if not self.transport.is_closing():
                self._set_phase(_IDLE, self.timeout_keep_alive)

    def _set_phase(self, phase: int, timeout_s: float) -> None:
        self._phase = phase
        self._deadline = self.loop.time() + timeout_s
        self._arm()

    def _arm(self) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_at(self._deadline, self._check)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _responding(self) -> bool:
        """An earlier request's response is still going out (a pipelined request waits for it)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _check(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing() or self._phase == _BUSY:
            return
        now = self.loop.time()
        if self._phase == _BODY:
            cycle, policy = self.cycle, self.guard.policy
            waiting = cycle is not None and cycle.waiting_for_100_continue and not cycle.response_complete
            if self.flow.read_paused or waiting:  # not the client's turn: the clock starts again when it is
                self._body_start, self._body_last, self._body_bytes = now, now, 0
            stalled = self._body_last + policy.body_timeout_s
            slow = self._body_start + policy.body_timeout_s + self._body_bytes / policy.body_min_rate
            self._deadline = min(stalled, slow)
            if now >= self._deadline:
                self._cut("body_timeout", None)
                return
        elif now >= self._deadline:
            if self._phase == _HEAD and self._responding():
                self._deadline = now + self.guard.policy.header_timeout_s
            elif self._phase == _HEAD:
                self._cut("header_timeout", _TIMEOUT)
                return
            else:
                new = self._phase == _NEW  # an expired keep-alive connection is no news
                self._cut("idle_timeout" if new else "keep_alive_timeout", None, warn=new)
                return
        self._arm()

    def _cut(self, kind: str, answer: bytes | None, warn: bool = True) -> None:
        self._cancel_timer()
        self.guard.note(kind, self.client_key, warn)
        if answer is not None and not self._responding():
            self.transport.write(answer)
        self.transport.close()


def protocol_for(guard: ConnectionGuard) -> type[GuardedHttpProtocol]:
    """The protocol class of one server's connections (uvicorn makes one instance per connection)."""

    class ServerHttpProtocol(GuardedHttpProtocol):
        pass

    ServerHttpProtocol.guard = guard
    return ServerHttpProtocol
