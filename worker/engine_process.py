"""Rank 0's engine in a process of its own (``GroupConfig.engine_process``; off by default: see docs/cluster.md).

A leader rank is a Ray actor: an asyncio event loop that answers the group's callers and streams each step's
deltas to its subscribers, plus Ray's own threads. With the engine on a thread of that process, every one of a
step's few hundred torch ops that releases the GIL has to win it back from them, and the step waits while the
event loop hands the last step's outputs over before the next one is asked for. Here the engine runs in a child
process (as vLLM's engine core and model worker do) that steps on its own for as long as it has work: it sends
each step's deltas and KV events as one message and reads its callers' requests between two steps, so it never
shares a GIL with the serving path and never waits for it.

``EngineProcess`` is the leader's side: the methods of ``Engine`` that ``RankActor`` calls, each sent to the
child and answered there between two steps, and a ``step()`` that returns what the child computed since the last
call (the deltas of one or more steps), so the actor's step loop is the same for either engine. Its calls come
from one thread at a time (the rank's engine thread). The child exits when its parent does (its socket closes).

Wire: the parent sends ``(method, args)``; the child sends ``("ready", info, events)`` once loaded (or
``("init_failed", error)``), ``("step", deltas, events, unfinished)`` after each step, ``("step_failed", error,
events)`` once a step raised (it steps no more; calls are still answered), and ``("ret" | "raise", value,
events, unfinished)`` for each call.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from common.events import EventSink, KVEvent, ListSink
from common.protocol import Delta, Submit

_log = logging.getLogger(__name__)

# What the parent may call: the methods of Engine that RankActor calls.
CALLS = frozenset(
    {"add_request", "abort", "stats", "pinned_entries", "held_keys", "forget_tenant", "close", "stop_followers"}
)


class EngineProcessDied(RuntimeError):
    """The engine's process exited (killed, out of memory, crashed): the group has failed."""


class EngineProcess:
    """A leader's engine running in a child process; see the module docstring."""

    def __init__(
        self,
        config: Any,  # worker.engine.EngineConfig
        sink: EventSink,
        threads: int = 1,
        world: int = 1,
        init_method: str = "",
        backend: str = "",
        start_timeout_s: float = 300.0,
    ) -> None:
        self._sink = sink
        self._pending: list[Delta] = []  # deltas of steps the child finished, not yet taken by step()
        self._unfinished = False  # the child's last word: it has requests left (so another message comes)
        self._failure: BaseException | None = None  # the step that raised; raised by step() once pending is out
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.engine_process", str(fd)],  # its name in ps and bench's CPU table
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send((config, threads, world, init_method, backend))
            if not self._conn.poll(start_timeout_s):
                raise TimeoutError(f"the engine process did not load within {start_timeout_s:g}s")
            msg = self._recv()
            if msg[0] == "init_failed":
                raise RuntimeError(f"the engine process failed to start: {msg[1]}")
        except BaseException:
            self.kill()
            raise
        _, self.info, events = msg
        self._publish(events)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """Stop the child now (its parent's exit does the same)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._conn.close()

    # -- Engine's interface ------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has something to give: deltas, a failure, or a child still stepping."""
        return bool(self._pending) or self._unfinished or self._failure is not None

    def step(self) -> list[Delta]:
        """The deltas of every step the child finished since the last call, waiting for the next one if there
        are none yet; the deltas of the last good step come out before its failure is raised."""
        while not self._pending and self._failure is None and self._unfinished:
            self._on_message(self._recv())  # no call is in flight here: only step messages come
        while self._conn.poll(0):  # steps the child ran ahead by go out together
            self._on_message(self._recv())
        if self._pending:
            out, self._pending = self._pending, []
            return out
        if self._failure is not None:
            raise self._failure
        return []

    def add_request(self, req: Submit) -> str:
        return self._call("add_request", req)

    def abort(self, request_id: str) -> bool:
        return self._call("abort", request_id)

    def stats(self) -> Any:
        return self._call("stats")

    def pinned_entries(self) -> list[tuple[str, list[int], float]]:
        return self._call("pinned_entries")

    def held_keys(self) -> Any:
        return self._call("held_keys")

    def forget_tenant(self, tenant: str) -> tuple[int, int]:
        return self._call("forget_tenant", tenant)

    def close(self) -> None:
        self._call("close")

    def stop_followers(self) -> None:
        self._call("stop_followers")

    # -- wire --------------------------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        try:
            self._conn.send((method, args))
        except OSError as exc:
            raise self._died() from exc
        while True:
            msg = self._recv()
            if msg[0] in ("ret", "raise"):
                kind, value, events, self._unfinished = msg
                self._publish(events)
                if kind == "raise":
                    raise value
                return value
            self._on_message(msg)

    def _on_message(self, msg: tuple) -> None:
        if msg[0] == "step":
            _, deltas, events, self._unfinished = msg
            self._publish(events)
            self._pending.extend(deltas)
        elif msg[0] == "step_failed":
            _, self._failure, events = msg
            self._publish(events)
            self._unfinished = False
        else:
            raise RuntimeError(f"unexpected message from the engine process: {msg[0]!r}")

    def _recv(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died() from exc

    def _died(self) -> EngineProcessDied:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return EngineProcessDied(f"the engine process (pid {self.proc.pid}) exited with code {code}")

    def _publish(self, events: list[KVEvent]) -> None:
        for e in events:
            self._sink.publish(e)


# -- the child -------------------------------------------------------------------------------------------------


def main() -> None:
    """The child's entry point: ``python -m worker.engine_process FD`` (FD: its end of the socket pair)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s engine-process %(levelname)s %(message)s")
    conn = Connection(int(sys.argv[1]))
    config, threads, world, init_method, backend = conn.recv()
    try:
        import torch

        from worker.engine import Engine

        torch.set_num_threads(threads)  # per OS thread under OpenMP: this (main) thread runs every step
        if world > 1:
            from worker.distributed import init_tensor_parallel

            init_tensor_parallel(0, world, init_method, backend)
        sink = ListSink()
        engine = Engine(config, event_sink=sink)
    except BaseException as exc:
        conn.send(("init_failed", f"{type(exc).__name__}: {exc}"))
        return
    kv = engine.runner.kv_cache
    info = {
        "kv_shape": list(kv.shape),
        "kv_bytes": kv.numel() * kv.element_size(),
        "step_threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    conn.send(("ready", info, sink.drain()))
    _Child(engine, sink, conn).run()


class _Child:
    def __init__(self, engine: Any, sink: ListSink, conn: Connection) -> None:
        self.engine, self.sink, self.conn = engine, sink, conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.failed = False
        self.parent = os.getppid()
        threading.Thread(target=self._read, name="kvgrid-engine-inbox", daemon=True).start()

    def _read(self) -> None:
        """Calls go to the inbox as they come, so a sender never blocks on a full socket while this process
        sends it steps. The parent's exit (the socket closes, or this process is re-parented) ends this one."""
        while True:
            try:
                if not self.conn.poll(1.0):
                    if os.getppid() != self.parent:
                        os._exit(0)
                    continue
                self.inbox.put(self.conn.recv())
            except (EOFError, OSError):
                os._exit(0)

    def run(self) -> None:
        engine = self.engine
        while True:
            if self.failed or not engine.has_unfinished():
                self._answer(self.inbox.get())  # idle: wait for a call
            while not self.inbox.empty():
                self._answer(self.inbox.get())
            if self.failed or not engine.has_unfinished():
                continue
            try:
                deltas = [Delta.of(out) for out in engine.step()]
            except Exception as exc:  # the group has failed: say why, then only answer calls
                _log.exception("the step failed")
                self.failed = True
                self.conn.send(("step_failed", _portable(exc), self.sink.drain()))
                continue
            self.conn.send(("step", deltas, self.sink.drain(), engine.has_unfinished()))

    def _answer(self, call: tuple[str, tuple]) -> None:
        method, args = call
        try:
            if method not in CALLS:
                raise ValueError(f"the engine process has no call {method!r}")
            value = getattr(self.engine, method)(*args)
        except Exception as exc:
            self.conn.send(("raise", _portable(exc), self.sink.drain(), self.engine.has_unfinished()))
            return
        self.conn.send(("ret", value, self.sink.drain(), self.engine.has_unfinished()))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles (the parent raises the same type), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
