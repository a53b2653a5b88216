"""One rank of a worker group (``RankActor``, a Ray actor). Rank 0 (the leader) runs the engine and serves the
group's callers: their subscriptions over its direct channel or a Ray stream, their submits and aborts, stats, KV
events and health; the other ranks follow its step plans. ``WorkerGroup`` (``worker/group.py``) places and starts
the ranks; callers reach the leader through ``GroupClient`` (``worker/group_client.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import os
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import ray

from common import channel, env
from common.channel import HEARTBEAT_S
from common.errors import GroupUnhealthyError
from common.events import EventLog, EventSink, HeldKeys, KVEvent, snapshot_events
from common.outputs import RequestOutput
from common.protocol import Delta, Submit
from common.stats import EngineStats
from worker.engine import Engine, EngineConfig, build_runner
from worker.engine_process import EngineProcess, EngineProcessDied

_log = logging.getLogger(__name__)
_stats_log = logging.getLogger("worker.stats")
STATS_INTERVAL_S = env.stats_interval_s()  # rank 0's stats line (a test's shorter)


def stats_line(
    group: str, prev: EngineStats | None, now: EngineStats, generated: int, seconds: float
) -> tuple[bool, str]:
    """A group's stats line over an interval of ``seconds`` (from ``prev`` to ``now``, ``generated`` output tokens
    in it), vLLM's figures: requests running and waiting, prompt and generation tokens/s, KV cache use (the GPU
    pool, and each lower tier configured) and the prefix cache hit rate of the prompts admitted meanwhile; and
    whether the group had work in it (else the line is worth showing only when it differs from the last one).
    ``prev`` None: the interval since the engine started (its counters from 0)."""
    before = prev.prefix_cache.values() if prev is not None else ()
    queried = sum(s.queried_tokens for s in now.prefix_cache.values()) - sum(s.queried_tokens for s in before)
    hits = sum(s.hit_tokens for s in now.prefix_cache.values()) - sum(s.hit_tokens for s in before)
    total = now.blocks_used + now.blocks_cached + now.blocks_free
    kv = [f"GPU {100 * now.blocks_used / max(1, total):.1f}%"]
    kv += [f"{tier} {100 * t.blocks / max(1, t.capacity):.1f}%" for tier, t in now.kv_tiers.items()]
    span = max(seconds, 1e-9)
    line = (
        f"group {group}: running {now.running} reqs, waiting {now.waiting} reqs, "
        f"prompt {max(0, queried) / span:.1f} tokens/s, generation {generated / span:.1f} tokens/s, "
        f"KV cache use {', '.join(kv)}, prefix cache hit rate {100 * max(0, hits) / max(1, queried):.1f}%"
    )
    return bool(now.running or now.waiting or queried > 0 or generated > 0), line


class _Subscriber:
    """Deltas waiting for one reader of the leader (a subscription, or one request's own stream)."""

    __slots__ = ("pending", "wake")

    def __init__(self) -> None:
        self.pending: list[Delta] = []
        self.wake = asyncio.Event()

    def push(self, delta: Delta) -> None:
        self.pending.append(delta)
        self.wake.set()


class RankActor:
    """One rank of a group. Rank 0 runs the engine; the others follow its step plans.

    Every engine call runs on one dedicated thread, in the order the calls came (a submit and the abort sent
    right after it cannot swap), and the step computes with ``threads`` intra-op threads: under OpenMP the
    thread count is per OS thread, so it is set in that thread, not in the actor."""

    def __init__(self, rank: int, world: int, threads: int = 1) -> None:
        self.rank, self.world, self.threads = rank, world, threads
        self.engine: Engine | EngineProcess | None = None
        self.events = EventLog()
        self.error: str | None = None
        self.step_threads: int | None = None  # what the engine thread computes with, once it has started
        self._engine_thread = ThreadPoolExecutor(1, "kvgrid-engine", self._set_threads, (threads,))
        self._subs: dict[str, _Subscriber] = {}
        self._owner: dict[str, _Subscriber] = {}  # request id -> who reads its deltas
        self._choices_left: dict[str, int] = {}  # n > 1: request id -> its choices not finished yet
        self._background: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self.step_timeout_s = 60.0
        self._step_started: float | None = None  # monotonic time the running step began
        self._channel: asyncio.Future | None = None  # the direct channel's server, once asked for
        self._channel_token = ""
        self.group = ""  # the group's name (rank 0's stats line)
        self._stats_line = False  # rank 0 under `kvgrid serve`: a stats line on its console every STATS_INTERVAL_S
        self._generated = 0  # output tokens the steps produced, for the stats line

    def _set_threads(self, n: int) -> None:
        import torch

        torch.set_num_threads(n)
        self.step_threads = torch.get_num_threads()

    def address(self) -> str:
        """A free TCP address on this node for the group's rendezvous (asked of rank 0 only)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"tcp://{ip}:{s.getsockname()[1]}"

    def setup(
        self,
        config: EngineConfig,
        init_method: str,
        backend: str,
        group: str = "",
        stream_url: str | None = None,
        engine_process: bool = False,
    ) -> dict:
        from worker.distributed import init_tensor_parallel

        in_child = engine_process and self.rank == 0  # then the child joins the group, not this process
        if self.world > 1 and not in_child:
            init_tensor_parallel(self.rank, self.world, init_method, backend)
        if config.kv_tiers.has_disk:  # every group keeps its block files apart (worker/kv_tiers.py)
            config = dataclasses.replace(config, kv_tiers=config.kv_tiers.for_group(group))
        if self.rank == 0:
            from common.log_relay import relay_logging

            self.group = group
            # Only with `kvgrid serve`'s log relay (common/log_relay.py): elsewhere the line would reach no console.
            self._stats_line = relay_logging(fallback=False)
            self.step_timeout_s = config.step_timeout_s
            sink: EventSink = self.events
            if stream_url:
                from common.event_stream import RedisStreamSink, TeeSink, stream_client

                # Buffered and written by a thread: a step never waits on Redis, and setup needs no Redis.
                sink = TeeSink(self.events, RedisStreamSink(stream_client(stream_url), group, snapshot=self._keys))
            if in_child:
                proc = self.engine = EngineProcess(config, sink, self.threads, self.world, init_method, backend)
                return {"rank": 0, "kv_shape": proc.info["kv_shape"], "kv_bytes": proc.info["kv_bytes"]}
            self.engine = Engine(config, event_sink=sink)
            runner = self.engine.runner
        else:
            runner = self.runner = build_runner(config)
        kv = runner.kv_cache
        return {"rank": self.rank, "kv_shape": list(kv.shape), "kv_bytes": kv.numel() * kv.element_size()}

    async def follow(self) -> None:
        """Ranks > 0: compute every plan rank 0 broadcasts, until it says stop (or the group breaks). On the
        engine thread, so the rank still answers ``info`` and ``health`` meanwhile."""
        await asyncio.get_running_loop().run_in_executor(self._engine_thread, self.runner.follow)

    # -- rank 0 ------------------------------------------------------------------------------------------------

    async def subscribe(self, subscriber: str) -> AsyncIterator[list[Delta]]:
        """The deltas of every request submitted under ``subscriber``, as a Ray stream (``KVGRID_GROUP_CHANNEL=ray``;
        the default is the direct channel, ``channel``): at most one message per engine step (an empty one first,
        once it is registered, and every ``HEARTBEAT_S`` when idle). When it ends (the group failed, or Ray closed
        it because its reader died) its unfinished requests are aborted."""
        sub = self._register(subscriber)
        try:
            yield []
            async for batch in self._batches(sub):
                yield batch
        finally:
            self._close(subscriber, sub)

    def _register(self, subscriber: str) -> _Subscriber:
        if self.error is not None:
            raise GroupUnhealthyError(self.error)
        if subscriber in self._subs:
            raise ValueError(f"subscription {subscriber!r} already exists")
        sub = self._subs[subscriber] = _Subscriber()
        return sub

    async def _batches(self, sub: _Subscriber) -> AsyncIterator[list[Delta]]:
        """A subscription's messages after the first: what its requests produced since the last one, at least
        every ``HEARTBEAT_S``; raises ``GroupUnhealthyError`` once the group has failed and nothing is pending."""
        while True:
            if self.error is None:  # once failed, nothing more comes: no wait before saying so
                try:
                    await asyncio.wait_for(sub.wake.wait(), HEARTBEAT_S)
                except TimeoutError:
                    pass
            batch = self._take(sub)
            # Deltas of the last good step go out first (a request that finished in it gets its result);
            # the failure is raised on the next pass, once nothing is pending.
            if not batch and self.error is not None:
                raise GroupUnhealthyError(self.error)
            yield batch

    async def channel(self) -> tuple[str, int, str]:
        """Where this leader's direct channel listens (``common/channel.py``): its node's address, a port, and
        the token a subscriber shows first. Started on the first ask."""
        if self._channel is None:
            self._channel_token = secrets.token_hex(16)
            self._channel = asyncio.ensure_future(
                asyncio.start_server(
                    self._on_channel, ray.util.get_node_ip_address(), 0, limit=channel.STREAM_LIMIT, backlog=256
                )
            )
        server = await asyncio.shield(self._channel)
        host, port = server.sockets[0].getsockname()[:2]
        return host, port, self._channel_token

    async def _on_channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One subscriber's connection: its submits and aborts in, its deltas out, until either side closes it;
        then its unfinished requests are aborted."""
        channel.no_delay(writer)
        try:
            try:
                token, subscriber = await asyncio.wait_for(channel.read_hello(reader), channel.HELLO_TIMEOUT_S)
            except (TimeoutError, ConnectionError):
                return
            if not hmac.compare_digest(token.encode(), self._channel_token.encode()):
                return
            try:
                sub = self._register(subscriber)
            except (GroupUnhealthyError, ValueError) as exc:
                writer.write(channel.frame(("failed", str(exc))))
                return
            sender = self._spawn(self._send_batches(sub, writer))
            try:
                while True:
                    kind, call, arg = await channel.read_frame(reader)
                    if kind == "submit":
                        self._spawn(self._channel_submit(sub, writer, call, arg))
                    elif kind == "abort":
                        self._spawn(self._channel_abort(arg))
            except (ConnectionError, ValueError, TypeError):  # closed, or not a message of this protocol
                pass
            finally:
                sender.cancel()
                self._close(subscriber, sub)
        finally:
            writer.close()

    async def _send_batches(self, sub: _Subscriber, writer: asyncio.StreamWriter) -> None:
        """The subscription's messages onto its connection. While the subscriber is slow to read (``drain``
        waits), the deltas of later steps collect and go out together."""
        try:
            writer.write(channel.frame(("deltas", [])))
            await writer.drain()
            async for batch in self._batches(sub):
                writer.write(channel.frame(("deltas", batch)))
                await writer.drain()
        except GroupUnhealthyError as exc:
            writer.write(channel.frame(("failed", str(exc))))
            writer.close()
        except ConnectionError:
            writer.close()

    async def _channel_submit(self, sub: _Subscriber, writer: asyncio.StreamWriter, call: int, req: Submit) -> None:
        reply: tuple[bool, object]
        try:
            reply = (True, await self._submit(sub, req))
        except Exception as exc:
            reply = (False, channel.portable_error(exc))
        if not writer.is_closing():
            writer.write(channel.frame(("reply", call, *reply)))

    async def _channel_abort(self, request_id: str) -> None:
        try:
            await self.abort(request_id)
        except GroupUnhealthyError:  # the group failed: its requests are gone with it
            pass
        except Exception:
            _log.exception("rank 0: aborting request %s failed", request_id)

    async def submit(self, subscriber: str, req: Submit) -> str:
        """Start a request whose deltas go to ``subscriber``'s subscription; returns its id."""
        sub = self._subs.get(subscriber)
        if sub is None and self.error is None:
            raise GroupUnhealthyError(f"subscription {subscriber!r} is closed")
        return await self._submit(sub, req)

    async def generate(self, req: Submit) -> AsyncIterator[list[Delta]]:
        """One request's deltas on a stream of its own (for blocking callers, see ``GroupClient.stream``)."""
        key = f"req-stream-{uuid.uuid4().hex}"
        sub = self._subs[key] = _Subscriber()
        try:
            await self._submit(sub, req)
            left = req.n  # choices not finished yet
            while left > 0:
                if self.error is None:
                    await sub.wake.wait()
                batch = self._take(sub)
                if not batch and self.error is not None:  # what the last good step produced goes out first
                    raise GroupUnhealthyError(self.error)
                left -= sum(1 for d in batch if d.finished)
                if any(d.aborted or d.error is not None for d in batch):
                    left = 0
                yield batch
        finally:
            self._close(key, sub)

    async def _submit(self, sub: _Subscriber | None, req: Submit) -> str:
        if self.error is not None:
            raise GroupUnhealthyError(self.error)
        assert self.engine is not None and sub is not None, "requests go to rank 0"
        if self._wake is None:
            self._wake = asyncio.Event()
            self._spawn(self._step_loop()).add_done_callback(self._step_loop_ended)
            if self._stats_line:
                self._spawn(self._stats_loop())
        req = req.named()
        rid = req.request_id
        assert rid is not None
        if rid in self._owner:
            raise ValueError(f"request id {rid!r} is already in use")
        self._owner[rid] = sub  # before the engine knows it: its first delta always finds its reader
        if req.n > 1:
            self._choices_left[rid] = req.n
        try:
            await self._run(self.engine.add_request, req)
        except BaseException:
            self._owner.pop(rid, None)
            self._choices_left.pop(rid, None)
            raise
        self._wake.set()
        return rid

    @staticmethod
    def _take(sub: _Subscriber) -> list[Delta]:
        sub.wake.clear()
        batch, sub.pending = sub.pending, []
        return batch

    def _close(self, key: str, sub: _Subscriber) -> None:
        """Forget a reader that is gone and abort its unfinished requests (in a task: this runs in a generator's
        ``finally``, where Ray may be closing it)."""
        self._subs.pop(key, None)
        orphans = [rid for rid, owner in self._owner.items() if owner is sub]
        for rid in orphans:
            del self._owner[rid]
            self._choices_left.pop(rid, None)
        if orphans and self.error is None:
            self._spawn(self._abort_all(orphans))

    async def _abort_all(self, request_ids: list[str]) -> None:
        assert self.engine is not None
        for rid in request_ids:
            try:
                await self._run(self.engine.abort, rid)
            except GroupUnhealthyError:  # the group failed meanwhile: its requests are gone with it
                return
            except Exception:  # nobody awaits this task: say it here, and still abort the others
                _log.exception("rank 0: aborting request %s of a closed subscription failed", rid)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _call_engine(self, fn, *args):
        """``fn(*args)`` on the engine thread, from another thread; gives up once the group has failed (a step
        stuck in a collective holds that thread for good)."""
        future = self._engine_thread.submit(fn, *args)
        while True:
            try:
                return future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if self.error is not None:
                    raise GroupUnhealthyError(self.error) from None
            except EngineProcessDied as exc:
                self.mark_unhealthy(str(exc))
                raise GroupUnhealthyError(self.error) from exc

    def _keys(self) -> HeldKeys:
        """Every key the pool holds (per tier, once the cache manager lists them so), read on the engine thread
        (the event writer's snapshot, from its thread)."""
        assert self.engine is not None
        return self._call_engine(self.engine.held_keys)

    async def _run(self, fn, *args):
        """``fn(*args)`` on the engine thread: the event loop never waits on a step (so ``health`` and
        ``mark_unhealthy`` answer even while a step hangs in a collective)."""
        future = asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.5)
            if done:
                try:
                    return future.result()
                except EngineProcessDied as exc:  # the group has failed, not just this call
                    self.mark_unhealthy(str(exc))
                    raise GroupUnhealthyError(self.error) from exc
            if self.error is not None:
                future.add_done_callback(lambda f: f.cancelled() or f.exception())  # its late error is expected
                raise GroupUnhealthyError(self.error)

    async def _step_loop(self) -> None:
        """Step while there is work, until the group fails. Any error in here fails the group: a loop that
        stopped without saying so would leave every request waiting forever on a group that reports healthy."""
        try:
            await self._steps()
        except Exception as exc:
            _log.exception("rank 0: the step loop failed")
            self.mark_unhealthy(f"step loop failed: {type(exc).__name__}: {exc}")

    def _step_loop_ended(self, task: asyncio.Task) -> None:
        """The step loop only returns once the group has failed; any other end (cancelled, say) fails it too."""
        if self.error is None:
            how = "was cancelled" if task.cancelled() else f"ended: {task.exception()!r}"
            self.mark_unhealthy(f"rank 0: the step loop {how}")

    async def _steps(self) -> None:
        assert self.engine is not None and self._wake is not None
        loop = asyncio.get_running_loop()
        while self.error is None:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            self._step_started = time.monotonic()
            step_fn: Callable[[], Sequence[RequestOutput | Delta]] = self.engine.step  # the child's are deltas
            step = loop.run_in_executor(self._engine_thread, step_fn)
            try:
                # shield: on timeout the step's thread cannot be stopped, only given up on
                outs = await asyncio.wait_for(asyncio.shield(step), self.step_timeout_s)
            except TimeoutError:
                self.mark_unhealthy(self._stuck_reason())
                step.add_done_callback(lambda f: f.cancelled() or f.exception())  # its late error is expected
                return
            except Exception as exc:  # a collective failed (a peer rank is gone), or the model forward raised
                self.mark_unhealthy(f"step failed: {type(exc).__name__}: {exc}")
                return
            finally:
                self._step_started = None
            touched = set()
            for out in outs:
                self._generated += len(out.new_token_ids)
                sub = self._owner.get(out.request_id)
                if sub is None:  # aborted meanwhile
                    continue
                if out.finished and self._last_choice(out.request_id, out.finish_reason == "error"):
                    del self._owner[out.request_id]
                sub.pending.append(out if isinstance(out, Delta) else Delta.of(out))
                touched.add(sub)
            for sub in touched:  # one wake per reader: all of its requests' deltas go in one message
                sub.wake.set()

    async def _stats_loop(self) -> None:
        """Rank 0: every ``STATS_INTERVAL_S`` while the group had work or its figures changed, a line like vLLM's
        (``stats_line``) on `kvgrid serve`'s console; none while it idles."""
        assert self.engine is not None
        prev: EngineStats | None = None
        generated, at, last = 0, time.monotonic(), ""  # the first interval: since the engine started (its first
        # request's tokens count there, even when it finished before the first sample)
        while self.error is None:
            await asyncio.sleep(STATS_INTERVAL_S)
            try:
                stats = await self._run(self.engine.stats)
            except Exception:  # the group failed (said elsewhere), or the engine is busy stopping
                continue
            now, gen = time.monotonic(), self._generated
            line = stats_line(self.group, prev, stats, gen - generated, now - at)
            if line[0] or line[1] != last:
                _stats_log.info("%s", line[1])
                last = line[1]
            prev, generated, at = stats, gen, now

    def _last_choice(self, request_id: str, failed: bool) -> bool:
        """A choice of ``request_id`` finished: whether the request has ended (every one of its ``n`` choices
        finished, or one failed: its reader stops there and aborts the others)."""
        left = self._choices_left.get(request_id, 1) - 1
        if left > 0 and not failed:
            self._choices_left[request_id] = left
            return False
        self._choices_left.pop(request_id, None)
        return True

    def mark_unhealthy(self, reason: str) -> None:
        """Fail every in-flight request; later requests are refused until the group is restarted."""
        if self.error is None:
            self.error = reason
        for sub in self._subs.values():
            sub.wake.set()

    async def abort(self, request_id: str) -> bool:
        """Stop a request; a reader still waiting on its outputs gets ``RequestAborted`` instead of waiting
        forever."""
        assert self.engine is not None
        done = await self._run(self.engine.abort, request_id)
        sub = self._owner.pop(request_id, None)
        self._choices_left.pop(request_id, None)
        if done and sub is not None:
            sub.push(Delta.abort(request_id))
        return done

    async def stats(self) -> EngineStats:
        assert self.engine is not None
        return await self._run(self.engine.stats)

    async def read_events(self, offset: int) -> tuple[list[KVEvent], int]:
        """KV events from ``offset`` on, and the offset to ask for next. A reader that fell too far behind
        gets a snapshot instead: ``AllCleared`` then every key the pool holds now, tier by tier."""
        assert self.engine is not None
        events, end = self.events.read(offset)
        if events is None:
            events = snapshot_events(await asyncio.to_thread(self._keys))
        return events, end

    def health(self) -> str | None:
        """None when healthy, else the reason the group failed; a step running longer than ``step_timeout_s``
        (a hung collective, a stopped peer) fails the group."""
        started = self._step_started
        if self.error is None and started is not None and time.monotonic() - started > self.step_timeout_s:
            self.mark_unhealthy(self._stuck_reason())
        if self.error is None and isinstance(self.engine, EngineProcess) and self.engine.proc.poll() is not None:
            self.mark_unhealthy(f"rank 0: the engine process exited with code {self.engine.proc.returncode}")
        return self.error

    def _stuck_reason(self) -> str:
        return f"rank 0: a step has not finished within step_timeout_s={self.step_timeout_s:g}s"

    def info(self) -> dict:
        """Where this rank runs (for operators and tests)."""
        child = self.engine if isinstance(self.engine, EngineProcess) else None
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "engine_pid": None if child is None else child.pid,  # rank 0's engine process, if it has one
            "node_id": ray.get_runtime_context().get_node_id(),
            "step_threads": self.step_threads if child is None else child.info["step_threads"],
        }

    async def forget_tenant(self, tenant: str) -> tuple[int, int]:
        """A deleted tenant: its pins released and its unused cached blocks forgotten on the engine thread
        (``Engine.forget_tenant``); (pins released, blocks forgotten)."""
        assert self.engine is not None
        return await self._run(self.engine.forget_tenant, tenant)

    async def pinned_entries(self) -> list[tuple[str, list[int], float]]:
        """Explicit cache entries pinned in this group: (tenant, prompt tokens, seconds left)."""
        assert self.engine is not None
        return await self._run(self.engine.pinned_entries)

    def shutdown(self) -> None:
        """Write the KV cache down to the disk tier, if any (for a few seconds at most, so that a restart finds
        it), then tell the other ranks to stop following (they return from ``follow``)."""
        if self.error is None and self.engine is not None:
            try:
                self._call_engine(self.engine.close)
            except Exception as exc:  # a failed write-down loses cached blocks, nothing else
                _log.warning("writing the KV cache down to disk failed: %s", exc)
            if self.world > 1:
                self._call_engine(self.engine.stop_followers)
