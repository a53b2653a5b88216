"""The caller's side of a worker group's leader (rank 0): the subscription that carries a caller's deltas
(``GroupLink``) and the client every call into a leader goes through (``GroupClient``). The messages are
``common/protocol.py``.

A caller with many requests on a group (a gateway replica) holds one subscription to the leader that carries at
most one message per engine step with the deltas of all of that caller's requests; ``GroupLink`` holds it, fans the
deltas out to each request's stream and rebuilds the cumulative ``RequestOutput`` the caller reads (``Outputs``).
One message per step instead of one object per request per token is what keeps a busy group's outputs from queueing
behind per-message overhead.

The subscription, and the submits and aborts of its requests, go over the leader's direct channel
(``common/channel.py``: one TCP connection, a pickle per message), not through Ray, whose per-call and per-message
cost in both processes was most of what HTTP lost against the engine; ``KVGRID_GROUP_CHANNEL=ray`` makes them Ray
calls and a Ray stream again. Every other call into the leader is a Ray call.

The leader ends a subscription when it fails (its requests then fail with ``GroupUnhealthyError``); when the
subscriber dies, its connection closes (over Ray: Ray closes the stream, which it reads with backpressure), and
the leader aborts that subscriber's requests.

Callers hold a ``GroupClient`` (a group's name and its leader's handle): the one wrapper through which the
gateway, the supervisor, the admin API and ``WorkerGroup`` call a leader. The errors that cross this boundary are
in ``common.errors``.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import TypeAlias

from common import channel, env
from common.errors import GroupUnhealthyError, group_error
from common.events import KVEvent
from common.outputs import RequestOutput
from common.protocol import Delta, Outputs, RankHandle, Submit
from common.stats import EngineStats

# Unconsumed subscription messages the leader may run ahead by. It must be bounded: only a bounded stream makes
# Ray close the leader's side when the subscriber dies. A slow reader is not slowed further: the leader keeps
# collecting its deltas and sends them together.
SUBSCRIPTION_BACKPRESSURE = 8


OnSilence: TypeAlias = Callable[[], Awaitable[None]]


def link_transport() -> str:
    """How a ``GroupLink`` talks to its leader: ``socket`` (the default: the leader's direct channel,
    ``common/channel.py``) or ``ray`` (a Ray call per submit and a Ray stream for the deltas; set
    ``KVGRID_GROUP_CHANNEL=ray`` where the gateways cannot open a TCP connection to the leaders' nodes)."""
    return env.group_channel()


class GroupLink:
    """This event loop's subscription to one group leader: every request it streams shares it. Made and kept by
    ``GroupClient.link``."""

    def __init__(self, group: str, leader: RankHandle) -> None:
        self.group, self.leader = group, leader
        self.id = f"sub-{uuid.uuid4().hex}"
        self.transport = link_transport()
        self._streams: dict[str, asyncio.Queue] = {}
        self._error: Exception | None = None
        self.messages = self.deltas = 0  # subscription messages and the deltas in them (batching, observed)
        self._writer: asyncio.StreamWriter | None = None  # the channel's, once connected (socket transport)
        self._calls: dict[int, asyncio.Future] = {}  # submits sent on the channel, by call id, until answered
        self._next_call = 0
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read())

    @property
    def closed(self) -> bool:
        return self._reader.done()

    async def _read(self) -> None:
        error: Exception = GroupUnhealthyError(f"worker group {self.group!r} closed its subscription")
        try:
            if self.transport == "ray":
                await self._read_ray()
            else:
                await self._read_channel()
        except channel.ChannelClosed:  # the leader's side closed without a word: it is gone
            pass
        except GroupUnhealthyError as exc:  # the leader said the group failed, or fell silent
            error = exc
        except Exception as exc:  # a Ray error (the group failed, or its leader died), a connection error
            error = group_error(exc, self.group)
        finally:  # also when cancelled (the loop is closing): no stream may wait on a reader that is gone
            self._error = error
            if not self._ready.done():
                self._ready.set_exception(error)
                self._ready.exception()  # read here, so a link nobody waited on logs nothing
            for queue in self._streams.values():
                queue.put_nowait(error)
            for call in self._calls.values():
                if not call.done():
                    call.set_exception(self._failed())
            self._calls.clear()

    def _deliver(self, batch: list[Delta]) -> None:
        if not self._ready.done():
            self._ready.set_result(None)
        if batch:
            self.messages += 1
            self.deltas += len(batch)
        for d in batch:
            queue = self._streams.get(d.request_id)
            if queue is not None:
                queue.put_nowait(d)

    async def _read_ray(self) -> None:
        import ray

        gen = self.leader.subscribe.options(_generator_backpressure_num_objects=SUBSCRIPTION_BACKPRESSURE).remote(
            self.id
        )
        try:
            async for ref in gen:
                self._deliver(await ref)
        except asyncio.CancelledError:  # this loop is closing, this process is not: end the leader's side too
            ray.cancel(gen)
            raise

    async def _read_channel(self) -> None:
        host, port, token = await self.leader.channel.remote()
        reader, writer = await asyncio.open_connection(host, port, limit=channel.STREAM_LIMIT)
        try:
            channel.no_delay(writer)
            writer.write(channel.hello(token, self.id))
            self._writer = writer
            while True:
                try:
                    async with asyncio.timeout(channel.SILENCE_S):
                        msg = await channel.read_frame(reader)
                except TimeoutError:
                    raise GroupUnhealthyError(
                        f"worker group {self.group!r} sent nothing on its channel for {channel.SILENCE_S:g} s"
                    ) from None
                kind = msg[0]
                if kind == "deltas":
                    self._deliver(msg[1])
                elif kind == "reply":
                    _, call, ok, value = msg
                    future = self._calls.pop(call, None)
                    if future is not None and not future.done():
                        if ok:
                            future.set_result(value)
                        else:
                            future.set_exception(value)
                elif kind == "failed":
                    raise GroupUnhealthyError(msg[1])
        finally:  # the leader aborts this subscriber's unfinished requests once it sees the channel closed
            writer.close()

    async def _submit(self, req: Submit) -> None:
        """Send ``req`` to the leader and wait until it has taken it (its deltas may come before the reply)."""
        if self.transport == "ray":
            from ray.exceptions import RayError

            try:
                await self.leader.submit.remote(self.id, req)
            except RayError as exc:
                raise group_error(exc, self.group) from None
            return
        writer = self._writer
        if writer is None or writer.is_closing() or self._error is not None:
            raise (
                self._failed()
                if self._error is not None
                else GroupUnhealthyError(f"worker group {self.group!r}: its channel is closed")
            )
        self._next_call += 1
        future = self._calls[self._next_call] = asyncio.get_running_loop().create_future()
        writer.write(channel.frame(("submit", self._next_call, req)))
        await future

    def _abort(self, request_id: str) -> None:
        """Abort a request of this link on the leader (not waiting for it)."""
        if self.transport == "ray":
            self.leader.abort.remote(request_id)
        elif self._writer is not None and not self._writer.is_closing():
            self._writer.write(channel.frame(("abort", 0, request_id)))

    def _failed(self) -> Exception:
        """A fresh copy of the link's error for one request (one instance raised in many tasks would collect
        all their tracebacks)."""
        assert self._error is not None
        return type(self._error)(*self._error.args)

    async def stream(
        self, req: Submit, on_silence: OnSilence | None = None, silence_s: float = 60.0
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request as the group produces them. The request is aborted on the group if this stream
        is closed before its end. ``await on_silence()`` runs after every ``silence_s`` without a delta (it may
        raise to end the stream)."""
        req = req.named()
        rid = req.request_id
        assert rid is not None
        try:
            await asyncio.shield(self._ready)
        except Exception:
            raise self._failed() from None
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue  # before the submit: the first delta may come before the submit's reply
        finished = False
        try:
            if self._error is not None:
                raise self._failed()
            try:
                await self._submit(req)
            except Exception:
                finished = True  # refused (or the group failed): there is nothing to abort
                raise
            outputs = Outputs(req, rid)
            while not finished:
                item = await self._next(queue, on_silence, silence_s)
                if isinstance(item, Exception):
                    finished = True
                    raise type(item)(*item.args)
                out = outputs.advance(item)
                finished = outputs.done
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished and self._error is None:
                self._abort(rid)

    @staticmethod
    async def _next(queue: asyncio.Queue, on_silence: OnSilence | None, silence_s: float):
        while on_silence is not None and queue.empty():  # no timer (and no task) while deltas keep coming
            try:
                async with asyncio.timeout(silence_s):
                    return await queue.get()
            except TimeoutError:
                await on_silence()
        return await queue.get()


class GroupClient:
    """The caller's side of one worker group: every call into a group's leader (rank 0) goes through here, from
    the gateway, the supervisor, the admin API and ``WorkerGroup`` (and through it the benchmarks and tests).

    Requests go in as a ``Submit`` and come back as cumulative ``RequestOutput``s: ``astream`` over this event
    loop's one subscription to the leader (``GroupLink``, shared by every request of the loop: what a gateway
    replica does), ``stream`` on a blocking stream of the request's own. Either aborts the request on the group
    when its reader stops before the end.

    Every call raises the errors of ``common.errors``: ``GroupUnhealthyError`` when the group failed or its
    leader is gone, the leader's own ``ValueError`` / ``RequestFailed`` / ``RequestAborted``, and
    ``TimeoutError`` when a unary call is not answered within its ``timeout_s``."""

    CALL_TIMEOUT_S = 30.0  # a unary call into the leader that takes longer means the group is stuck

    def __init__(self, group: str, leader: RankHandle) -> None:
        self.group, self.leader = group, leader
        self._links: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GroupLink] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"GroupClient({self.group!r})"

    # -- requests ----------------------------------------------------------------------------------------------

    def link(self) -> GroupLink:
        """This event loop's subscription to the leader: made on first use, and anew once the old one closed
        (its group failed)."""
        loop = asyncio.get_running_loop()
        link = self._links.get(loop)
        if link is None or link.closed:
            link = self._links[loop] = GroupLink(self.group, self.leader)
        return link

    async def astream(
        self, req: Submit, on_silence: OnSilence | None = None, silence_s: float = 60.0
    ) -> AsyncGenerator[RequestOutput, None]:
        """One request's outputs over this loop's subscription (see ``GroupLink.stream``); closing it early
        aborts the request now."""
        stream = self.link().stream(req, on_silence, silence_s)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def stream(self, req: Submit, timeout_s: float | None = None) -> Iterator[RequestOutput]:
        """One request's outputs for a blocking caller: a short stream of its own from the leader, one message
        per step; the request is aborted if the caller stops reading before its end. ``GroupUnhealthyError`` when
        the leader sends nothing for ``timeout_s`` (each wait, not the whole request)."""
        import ray
        from ray.exceptions import RayError

        req = req.named()
        rid = req.request_id
        assert rid is not None
        outputs, finished = Outputs(req, rid), False
        try:
            gen = self.leader.generate.options(_generator_backpressure_num_objects=SUBSCRIPTION_BACKPRESSURE).remote(
                req
            )
            while not finished:  # the leader's stream ends with the request's finish: nothing is read after it
                ready, _ = ray.wait([gen], timeout=timeout_s)  # a leader that sends nothing fails the wait, too
                if not ready:
                    raise GroupUnhealthyError(f"worker group {self.group!r} sent no output for {timeout_s:g} s")
                ref = next(gen, None)
                if ref is None:
                    raise GroupUnhealthyError(
                        f"worker group {self.group!r} ended the stream before the request finished"
                    )
                for d in ray.get(ref):
                    out = outputs.advance(d)
                    finished = outputs.done
                    yield out
        except RayError as exc:
            raise group_error(exc, self.group) from exc
        finally:
            if not finished:  # also after a timeout; a failed group ignores it
                self.leader.abort.remote(rid)

    def run(self, req: Submit, timeout_s: float | None = None) -> RequestOutput:
        """One request run to its end (blocking); its last output."""
        last = None
        for out in self.stream(req, timeout_s):
            last = out
        assert last is not None
        return last

    # -- unary calls -------------------------------------------------------------------------------------------

    def _get(self, ref, timeout_s: float):
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:  # a TimeoutError: not answering is not (yet) a failure
            raise
        except RayError as exc:
            raise group_error(exc, self.group) from exc

    async def _aget(self, ref, timeout_s: float):
        from ray.exceptions import RayError

        try:
            return await asyncio.wait_for(ref, timeout_s)
        except RayError as exc:
            raise group_error(exc, self.group) from exc

    def abort(self, request_id: str, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        """Stop a request; its reader gets ``RequestAborted``. False when the group does not know it."""
        return self._get(self.leader.abort.remote(request_id), timeout_s)

    def stats(self, timeout_s: float = CALL_TIMEOUT_S) -> EngineStats:
        """The leader's engine counters (load, blocks, prefix-cache hits)."""
        return self._get(self.leader.stats.remote(), timeout_s)

    async def astats(self, timeout_s: float = CALL_TIMEOUT_S) -> EngineStats:
        return await self._aget(self.leader.stats.remote(), timeout_s)

    def read_events(self, offset: int, timeout_s: float = CALL_TIMEOUT_S) -> tuple[list[KVEvent], int]:
        """KV events from ``offset`` on and the next offset (see ``RankActor.read_events``)."""
        return self._get(self.leader.read_events.remote(offset), timeout_s)

    def pinned_entries(self, timeout_s: float = CALL_TIMEOUT_S) -> list[tuple[str, list[int], float]]:
        """The explicit cache entries pinned in the group: (tenant, prompt tokens, seconds left)."""
        return self._get(self.leader.pinned_entries.remote(), timeout_s)

    def health(self, timeout_s: float = CALL_TIMEOUT_S) -> str | None:
        """None when the leader reports no failure, else its reason (a step stuck for longer than its
        ``step_timeout_s`` fails the group)."""
        return self._get(self.leader.health.remote(), timeout_s)

    async def ahealth(self, timeout_s: float = CALL_TIMEOUT_S) -> str | None:
        return await self._aget(self.leader.health.remote(), timeout_s)

    def mark_unhealthy(self, reason: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Fail the group's requests (a rank died): it refuses requests until it is restarted."""
        self._get(self.leader.mark_unhealthy.remote(reason), timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell the followers to stop following (they return from ``follow``)."""
        self._get(self.leader.shutdown.remote(), timeout_s)
