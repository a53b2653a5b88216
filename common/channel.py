"""The direct channel between a group's leader (rank 0) and one subscriber: a TCP connection that carries the
subscriber's submits and aborts one way and its requests' deltas, one message per engine step, the other.

Why not a Ray call: every Ray call and every message of a Ray stream goes through Ray's core-worker threads in
both processes (serialization into the object store's format, a gRPC round, the task's bookkeeping). On 2 cores
with 8 streams the leader's process spent about 40% more CPU than its engine steps, and each gateway request a
dozen milliseconds on Ray calls; here a message is one ``pickle`` and one socket write on each side, on the
processes' event loops. Ray still places the group, tells the subscriber where the channel is
(``RankActor.channel``: the leader's node address, a port and a token), and carries every other call (stats,
health, events, the supervisor's control).

Frames are a 4-byte big-endian length and a pickle. Pickle runs code on load, so the leader reads nothing before
the connecting side has shown the channel's token (random per leader, given out only over Ray): only a process
of the Ray cluster can connect.

Messages (tuples; the first item says what it is):

- subscriber -> leader: first ``(token, subscriber_id)``; then ``("submit", call_id, Submit)``,
  ``("abort", 0, request_id)``.
- leader -> subscriber: ``("deltas", [Delta, ...])`` (the first, empty, once the subscription is registered; an
  empty one every ``HEARTBEAT_S`` when idle), ``("reply", call_id, ok, value)`` (``value``: the request id, or the
  error when not ``ok``), ``("failed", reason)`` as the last frame once the group has failed.

When the connection closes, the leader aborts the subscriber's unfinished requests (a subscriber process that
dies closes it: its kernel sends the FIN); a subscriber that hears nothing for ``SILENCE_S`` (a leader's node
gone without a word) takes the group for failed.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

HEARTBEAT_S = 5.0  # an idle subscription still gets a message this often, so either side notices the other is gone

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30  # a frame longer than this is a broken peer, not a message
SILENCE_S = 4 * HEARTBEAT_S  # no frame from the leader for this long: it is gone
HELLO_TIMEOUT_S = 10.0  # a connection that has not shown its token by then is closed
STREAM_LIMIT = 1 << 20  # asyncio reader buffer


class ChannelClosed(ConnectionError):
    """The peer closed the channel (or sent something that is not a frame)."""


def frame(obj: object) -> bytes:
    """``obj`` as one frame (one ``write`` call: frames written from several tasks never interleave)."""
    body = pickle.dumps(obj, protocol=5)
    return _HEADER.pack(len(body)) + body


async def _read_body(reader: asyncio.StreamReader, limit: int) -> bytes:
    try:
        (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if n > limit:
            raise ChannelClosed(f"a frame of {n} bytes (at most {limit})")
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise ChannelClosed("the peer closed the channel") from None


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object; ``ChannelClosed`` at the end of the stream or on a malformed frame."""
    body = await _read_body(reader, MAX_FRAME)
    try:
        return pickle.loads(body)
    except Exception as exc:
        raise ChannelClosed(f"a frame that does not unpickle: {type(exc).__name__}") from None


def hello(token: str, subscriber: str) -> bytes:
    """The subscriber's first frame: the token and its id, as plain text (the leader unpickles nothing before it
    has checked the token)."""
    body = f"{token}\n{subscriber}".encode()
    return _HEADER.pack(len(body)) + body


async def read_hello(reader: asyncio.StreamReader) -> tuple[str, str]:
    """(token, subscriber id) of a connection's first frame; ``ChannelClosed`` for anything else."""
    try:
        token, subscriber = (await _read_body(reader, 1024)).decode().split("\n")
    except (UnicodeDecodeError, ValueError):
        raise ChannelClosed("the first frame is not a hello") from None
    return token, subscriber


def no_delay(writer: asyncio.StreamWriter) -> None:
    """Send small frames at once (a delta message is a few hundred bytes; Nagle would hold it for the ACK)."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip (the errors of ``common.errors`` and ``ValueError`` do), else a
    ``RuntimeError`` with its text."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=5))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
