"""A worker group: ``tp`` Ray actors in one STRICT_PACK placement group that serve as one engine.

Rank 0 (the leader) owns the scheduler, the block pool and the key map and runs the engine; each step it
broadcasts the step's plan and every rank computes its shard of the model (``torch.distributed``: NCCL on CUDA,
gloo on CPU). The router talks to the group through ``WorkerGroup``: stream a request's outputs, abort it,
read the group's load and drain its KV events (each through its ``GroupClient``, ``common/protocol.py``). If any
rank dies the group turns unhealthy, fails its in-flight requests with ``GroupUnhealthyError``, and ``restart()``
brings it back as a whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import os
import re
import secrets
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray
from ray.exceptions import RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common import channel
from common.channel import HEARTBEAT_S
from common.errors import GroupUnhealthyError, RequestAborted, RequestFailed  # noqa: F401  (re-exported)
from common.events import EventLog, EventSink, HeldKeys, KVEvent, snapshot_events
from common.outputs import RequestOutput
from common.protocol import Delta, GroupClient, RankHandle, Submit
from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig, EngineStats, build_runner
from worker.engine_process import EngineProcess, EngineProcessDied

_log = logging.getLogger(__name__)
_stats_log = logging.getLogger("worker.stats")
STATS_INTERVAL_S = float(os.environ.get("KVGRID_STATS_INTERVAL_S", "10"))  # rank 0's stats line (a test's shorter)


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


@dataclass
class GroupConfig:
    name: str
    engine: EngineConfig
    tp: int = 1
    use_gpu: bool = False  # one GPU per rank (NCCL); otherwise CPU bundles (gloo)
    event_stream_url: str | None = None  # also publish KV events to this Redis (one stream per group)
    start_timeout_s: float = 300.0
    accelerator: str | None = None  # resource each rank takes one of: "GPU" with use_gpu, or a custom one
    # Intra-op threads each rank computes its steps with. Ray reserves one CPU per rank whatever this is, so
    # groups stay placeable on a small machine; size it to the cores the node really has for its ranks.
    cpus_per_rank: int = 1
    # Rank 0's engine steps in a child process of the rank (worker/engine_process.py), away from the actor's
    # event loop and Ray's threads; False (the default): on a thread of the rank actor itself.
    engine_process: bool = False


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
        rid = req.request_id if req.request_id is not None else f"req-{uuid.uuid4().hex}"
        if rid in self._owner:
            raise ValueError(f"request id {rid!r} is already in use")
        self._owner[rid] = sub  # before the engine knows it: its first delta always finds its reader
        if req.n > 1:
            self._choices_left[rid] = req.n
        try:
            await self._run(
                self.engine.add_request,
                req.prompt,
                req.params,
                req.tenant,
                rid,
                req.pin_tokens,
                req.pin_ttl_s,
                req.n,
            )
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


class WorkerGroup:
    """Driver-side handle of one group (what the router holds)."""

    CALL_TIMEOUT_S = GroupClient.CALL_TIMEOUT_S

    def __init__(self, config: GroupConfig, start: bool = True) -> None:
        self.config = config
        self.ranks: list[RankHandle] = []
        self.rank_info: list[dict] = []
        self._pg: PlacementGroup | None = None
        self._follows: list[ray.ObjectRef] = []
        self._client: GroupClient | None = None  # of the current leader (a restart makes a new one)
        if start:
            self.start()

    @classmethod
    def adopt(cls, config: GroupConfig) -> WorkerGroup | None:
        """A handle on the group ``config.name`` that a previous owner started (its ranks and placement group
        are detached and named, so they outlive that owner): found by name, nothing is started. None when its
        placement group is gone. A rank that is gone shows in ``health()``, and ``restart()`` replaces them all."""
        try:
            pg = get_placement_group(pg_name(config.name))
        except ValueError:
            return None
        if placement_group_table(pg).get("state") == "REMOVED":
            return None
        group = cls(config, start=False)
        group._pg = pg
        for r in range(config.tp):
            try:
                group.ranks.append(ray.get_actor(rank_name(config.name, r)))
            except ValueError:  # not started yet, or dead: the group is incomplete
                break
        return group

    @staticmethod
    def remove_all() -> list[str]:
        """Kill every kvgrid rank actor and remove every kvgrid placement group of this Ray namespace, whoever
        started them (they are detached: nothing else frees them). Returns what was removed."""
        removed = []
        for name in ray.util.list_named_actors():
            if _RANK_NAME.fullmatch(name):
                try:
                    ray.kill(ray.get_actor(name), no_restart=True)
                    removed.append(name)
                except ValueError:  # it died meanwhile
                    pass
        names = {info.get("name", "") for info in placement_group_table().values() if info.get("state") != "REMOVED"}
        for name in sorted(n for n in names if n.startswith("kvgrid-")):
            try:
                remove_placement_group(get_placement_group(name))  # only this namespace's
                removed.append(name)
            except ValueError:  # another namespace's, or removed meanwhile
                pass
        return removed

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def leader(self) -> RankHandle:
        return self.ranks[0]

    @property
    def client(self) -> GroupClient:
        """The client of this group's current leader (every call into the group goes through it)."""
        if self._client is None or self._client.leader != self.leader:
            self._client = GroupClient(self.name, self.leader)
        return self._client

    def start(self) -> None:
        """Reserve the group's placement group and start its ranks; on any failure nothing stays reserved."""
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        cfg = self.config
        accel = cfg.accelerator or ("GPU" if cfg.use_gpu else None)
        per_rank = {"CPU": 1, accel: 1} if accel else {"CPU": 1}
        # Groups start in parallel (Supervisor.scale); each picks its node from the placement groups already
        # placed, so one picks and is placed at a time: two would otherwise pick the same emptiest node.
        with _PLACING:
            node = self._target_node(accel or "CPU")
            # Detached (like the ranks): the group outlives a crash of the supervisor that started it, which
            # adopts it again by name when Ray restarts it. ``shutdown()`` and ``remove_all()`` free them.
            pg = self._pg = placement_group(
                [per_rank] * cfg.tp,
                strategy="STRICT_PACK",
                name=pg_name(cfg.name),
                bundle_label_selector=[{"ray.io/node-id": node}] * cfg.tp,
                lifetime="detached",
            )
            ray.get(pg.ready(), timeout=cfg.start_timeout_s)
        actor = ray.remote(RankActor)
        self.ranks = [
            actor.options(
                num_cpus=1,
                num_gpus=1 if accel == "GPU" else 0,
                resources={accel: 1} if accel and accel != "GPU" else None,
                name=rank_name(cfg.name, r),
                lifetime="detached",
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
            ).remote(r, cfg.tp, cfg.cpus_per_rank)
            for r in range(cfg.tp)
        ]
        init_method = ray.get(self.leader.address.remote(), timeout=cfg.start_timeout_s)
        backend = "nccl" if cfg.use_gpu else "gloo"
        self.rank_info = ray.get(
            [
                a.setup.remote(cfg.engine, init_method, backend, cfg.name, cfg.event_stream_url, cfg.engine_process)
                for a in self.ranks
            ],
            timeout=cfg.start_timeout_s,
        )
        self._follows = [a.follow.remote() for a in self.ranks[1:]]

    def _target_node(self, resource: str) -> str:
        """The node for this group: one with ``tp`` units of ``resource`` not reserved by other kvgrid groups,
        preferring the most free, then the fewest kvgrid groups, so groups spread over nodes. A group never
        waits for a node that cannot hold it whole."""
        reserved: dict[str, float] = defaultdict(float)
        groups_on: dict[str, int] = defaultdict(int)
        for pg in placement_group_table().values():
            if not pg.get("name", "").startswith("kvgrid-") or pg.get("state") == "REMOVED":
                continue
            for index, node in pg["bundles_to_node_id"].items():
                reserved[node] += pg["bundles"][index].get(resource, 0)
            for node in set(pg["bundles_to_node_id"].values()):
                groups_on[node] += 1
        best: tuple[float, int, str] | None = None
        for n in ray.nodes():
            if not n["Alive"]:
                continue
            free = n["Resources"].get(resource, 0) - reserved[n["NodeID"]]
            if free >= self.config.tp and (best is None or (free, -groups_on[n["NodeID"]]) > best[:2]):
                best = (free, -groups_on[n["NodeID"]], n["NodeID"])
        if best is None:
            raise RuntimeError(
                f"worker group {self.config.name!r} needs {self.config.tp} x {resource} on one node; "
                "no node has them free"
            )
        return best[2]

    def health(self) -> str | None:
        """None when every rank is alive and the leader reports no failure, else the reason."""
        if not self.ranks:
            return "not running"
        if len(self.ranks) < self.config.tp:  # adopted incomplete
            return f"rank {len(self.ranks)} is gone"
        if not self._follows:  # adopted: the followers' ``follow`` calls belong to the previous owner
            for r in range(1, self.config.tp):
                try:
                    ray.get_actor(rank_name(self.name, r))  # a dead rank's name is free again
                except ValueError:
                    reason = f"rank {r} is gone"
                    self._tell_leader(reason)
                    return reason
        done, _ = ray.wait(self._follows, num_returns=len(self._follows), timeout=0) if self._follows else ([], [])
        for ref in done:  # a follower only returns early when its rank died or the group broke
            reason = f"rank {self._follows.index(ref) + 1} stopped"
            try:
                ray.get(ref)
            except RayError as exc:
                reason = f"rank {self._follows.index(ref) + 1} died: {type(exc).__name__}"
            self._tell_leader(reason)
            return reason
        try:
            return self.client.health(timeout_s=30)
        except (GroupUnhealthyError, TimeoutError) as exc:  # dead, or too stuck to answer
            return f"rank 0 is not answering: {type(exc.__cause__ or exc).__name__}"

    def _tell_leader(self, reason: str) -> None:
        try:
            self.client.mark_unhealthy(reason, timeout_s=30)
        except (GroupUnhealthyError, TimeoutError):
            pass

    def rank_infos(self, timeout_s: float = 10.0) -> list[dict]:
        """Where each rank runs (``RankActor.info``), asked of all ranks at once."""
        return ray.get([r.info.remote() for r in self.ranks], timeout=timeout_s)

    def stream(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        tenant: str = "default",
        request_id: str | None = None,
        pin_tokens: int = 0,
        pin_ttl_s: float = 300.0,
    ) -> Iterator[RequestOutput]:
        """Outputs of one request as the group produces them (blocking iterator)."""
        return self.client.stream(_submit(prompt, params, tenant, request_id, pin_tokens, pin_ttl_s))

    def astream(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        tenant: str = "default",
        request_id: str | None = None,
        pin_tokens: int = 0,
        pin_ttl_s: float = 300.0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the group produces them, over this event loop's one subscription to the
        leader (what a gateway replica does)."""
        return self.client.astream(_submit(prompt, params, tenant, request_id, pin_tokens, pin_ttl_s))

    def generate(
        self, prompt: list[int], params: SamplingParams | None = None, tenant: str = "default"
    ) -> RequestOutput:
        """Run one request to completion."""
        return self.client.run(_submit(prompt, params, tenant))

    def abort(self, request_id: str, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        return self.client.abort(request_id, timeout_s)

    def stats(self, timeout_s: float = CALL_TIMEOUT_S) -> EngineStats:
        """The leader's engine counters; ``TimeoutError`` when it does not answer within ``timeout_s``."""
        return self.client.stats(timeout_s)

    def read_events(self, offset: int, timeout_s: float = CALL_TIMEOUT_S) -> tuple[list[KVEvent], int]:
        """KV events from ``offset`` on and the next offset (see ``RankActor.read_events``)."""
        return self.client.read_events(offset, timeout_s)

    def pinned_entries(self, timeout_s: float = CALL_TIMEOUT_S) -> list[tuple[str, list[int], float]]:
        """The explicit cache entries pinned in this group (see ``RankActor.pinned_entries``)."""
        return self.client.pinned_entries(timeout_s)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank and free the placement group (``graceful``: first let the followers return, for
        at most 10 s; pointless when the group is known to hang)."""
        if graceful and self.ranks:
            try:
                self.client.shutdown(timeout_s=10)
            except Exception:  # the group may already be broken; killing below is what matters
                pass
        for a in self.ranks:
            try:
                ray.kill(a, no_restart=True)
            except ValueError:  # already gone
                pass
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:  # the GCS did not answer: remove_all() at exit still finds it by name
                _log.warning("could not remove the placement group of %s: %s", self.name, exc)
        self.ranks, self._follows, self._pg, self._client = [], [], None, None

    def restart(self) -> None:
        """Replace the whole group (all ranks) with fresh actors; its cache starts empty."""
        self.shutdown()
        self.start()


def _submit(
    prompt: list[int],
    params: SamplingParams | None,
    tenant: str,
    request_id: str | None = None,
    pin_tokens: int = 0,
    pin_ttl_s: float = 300.0,
) -> Submit:
    return Submit(list(prompt), params or SamplingParams(), tenant, request_id, pin_tokens, pin_ttl_s)


def pg_name(group: str) -> str:
    return f"kvgrid-{group}"


def rank_name(group: str, rank: int) -> str:
    return f"kvgrid-{group}-rank{rank}"


_PLACING = threading.Lock()  # WorkerGroup._start: one group chooses its node and is placed at a time
_RANK_NAME = re.compile(r"kvgrid-.+-rank[0-9]+")
RAY_NAMESPACE = "kvgrid"  # where the named (detached) group actors live, so a restarted supervisor finds them


def init_local_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    """Start (or join, with ``address``) Ray in the kvgrid namespace; a local start stays on loopback with auth
    disabled."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts its workers at nice 15 unless told otherwise: every actor of kvgrid (the ranks' engine threads
    # first) would give way to any process at the default priority on the node (a load generator, a log
    # shipper). On 2 cores under 32 streams the engine thread waited for a core 22% of the time either way (its
    # competitors are kvgrid's own actors), and 6% when given priority over everything (nice -10, root only).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # A CPU rank's OpenMP threads sleep as soon as a parallel region ends instead of spinning for the next one
    # on the cores the HTTP path needs (on 2 cores under 32 streams a rank's second thread spun about 0.1 core
    # away). Set here, inherited by every Ray worker, rather than as a per-actor runtime_env, which makes Ray
    # start a dedicated worker process for each rank through its runtime-env agent.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Ray reports every actor call's state changes (for its dashboard's task list and `ray list tasks`, which
    # kvgrid does not use) from each process: a request makes several calls and a stream one message per step.
    # Off, the HTTP figures on 2 cores were 3-9% higher in four A/B pairs (8 and 32 streams). Set the variable
    # to a positive interval (ms) to have them again.
    os.environ.setdefault("RAY_task_events_report_interval_ms", "0")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
    else:
        ray.init(
            address="local",  # always a new instance: never join another Ray running on this machine
            namespace=RAY_NAMESPACE,
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=256 * 2**20,
            log_to_driver=False,
        )
