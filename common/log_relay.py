"""The log relay: the log records of kvgrid's Ray actors (the gateway replicas' access log, the supervisor's control
events) on the console of `kvgrid serve`.

Ray keeps an actor's stdout and stderr in its own log folder (kvgrid starts Ray with ``log_to_driver`` off: Ray's
forwarding would put a prefix before every line, fold lines that look alike, and bring every library's noise along).
Instead, each actor's kvgrid loggers hand their records to a ``RelayHandler``: it turns them into plain dicts
(the message already formatted with its arguments, the exception as text) and a thread of the process sends them
in batches, every ``FLUSH_INTERVAL_S``, to the ``LogRelay`` actor. `kvgrid serve` reads them from there
(``RelayReader``) and hands each to its own logger of the same name, so they come out in the configured format
(``logging.format``): the access log on stdout, the rest on stderr.

Logging never waits on the relay: a record is appended to a bounded buffer (the oldest are dropped, and counted,
when the relay cannot keep up or is gone); a batch the relay did not take is written to the actor's own stderr."""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import time
from typing import Any

from common.logs import RequestIdFilter, configure_logging, formatter, install

RELAY_NAME = "kvgrid-log"
RELAY_NAMESPACE = "kvgrid"  # worker.group.RAY_NAMESPACE: `kvgrid serve`'s namespace (Serve's replicas run in another)
FLUSH_INTERVAL_S = 0.2  # an actor sends its records at most this late
SEND_TIMEOUT_S = 10.0
READ_WAIT_S = 1.0  # a read of the relay returns after this long without records
MAX_PENDING = 20_000  # records an actor, and the relay, hold at most (the oldest are dropped past it)

log = logging.getLogger(__name__)


def to_dict(record: logging.LogRecord) -> dict[str, Any]:
    """What a record is on the console (message with its arguments, exception text), as plain data."""
    exc_text = record.exc_text
    if record.exc_info and not exc_text:
        exc_text = logging.Formatter().formatException(record.exc_info)
    out: dict[str, Any] = {
        "name": record.name,
        "levelno": record.levelno,
        "levelname": record.levelname,
        "msg": record.getMessage(),
        "created": record.created,
        "msecs": record.msecs,
    }
    if exc_text:
        out["exc_text"] = exc_text
    for key in ("fields", "request_id", "inline"):
        value = getattr(record, key, None)
        if value is not None:
            out[key] = value
    return out


def from_dict(data: dict[str, Any]) -> logging.LogRecord:
    created = float(data["created"])
    msecs = data.get("msecs", (created - int(created)) * 1000)
    record = logging.makeLogRecord({**data, "args": None, "created": created, "msecs": msecs})
    if not hasattr(record, "request_id"):
        record.request_id = None  # not this process's request: RequestIdFilter must leave it
    return record


class LogRelay:
    """The Ray actor between the actors that log and `kvgrid serve`, which reads (one reader)."""

    def __init__(self) -> None:
        self._records: collections.deque[dict] = collections.deque(maxlen=MAX_PENDING)
        self._dropped = 0
        self._waiter: asyncio.Event | None = None

    async def write(self, records: list[dict], dropped: int = 0) -> None:
        self._dropped += dropped + max(0, len(self._records) + len(records) - MAX_PENDING)
        self._records.extend(records)
        if self._waiter is not None:
            self._waiter.set()

    async def read(self, wait_s: float = READ_WAIT_S) -> tuple[list[dict], int]:
        """The records written since the last read (waiting up to ``wait_s`` for one), and how many were dropped."""
        if not self._records:
            self._waiter = asyncio.Event()
            try:
                await asyncio.wait_for(self._waiter.wait(), wait_s)
            except TimeoutError:
                pass
            finally:
                self._waiter = None
        records = list(self._records)
        self._records.clear()
        dropped, self._dropped = self._dropped, 0
        return records, dropped


class _Sender:
    """This process's buffer of records for the relay and the thread that sends them."""

    def __init__(self, relay: Any) -> None:
        self.relay = relay
        self._pending: collections.deque[dict] = collections.deque(maxlen=MAX_PENDING)
        self._dropped = 0
        self._mu = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvgrid-log-relay", daemon=True)
        self._thread.start()

    def add(self, data: dict) -> None:
        with self._mu:
            if len(self._pending) == MAX_PENDING:
                self._dropped += 1
            self._pending.append(data)

    def _run(self) -> None:
        import ray

        while True:
            time.sleep(FLUSH_INTERVAL_S)
            with self._mu:
                if not self._pending and not self._dropped:
                    continue
                batch, self._pending = list(self._pending), collections.deque(maxlen=MAX_PENDING)
                dropped, self._dropped = self._dropped, 0
            try:
                ray.get(self.relay.write.remote(batch, dropped), timeout=SEND_TIMEOUT_S)
            except Exception as exc:  # the relay is gone (kvgrid serve is stopping) or stuck: keep them here
                fallback = formatter("text")
                print(f"log relay unavailable ({type(exc).__name__}); {len(batch)} records:", file=sys.stderr)
                for data in batch:
                    print(fallback.format(from_dict(data)), file=sys.stderr)
                sys.stderr.flush()


class RelayHandler(logging.Handler):
    """Hands every record to the process's ``_Sender`` (never blocks on the relay)."""

    def __init__(self, sender: _Sender) -> None:
        super().__init__()
        self.sender = sender
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sender.add(to_dict(record))
        except Exception:
            self.handleError(record)


_sender: _Sender | None = None


def relay_logging(access_log: bool = True, fallback: bool = True) -> bool:
    """In a Ray actor: kvgrid's log records (and the access log) go to `kvgrid serve`'s console through the relay.
    Without a relay (an actor a test started on its own Ray) they go to this process's stderr and stdout instead
    (``configure_logging``), or, without ``fallback``, where they went before. True when the relay takes them."""
    global _sender
    import ray

    try:
        relay = ray.get_actor(RELAY_NAME, namespace=RELAY_NAMESPACE)
    except Exception:  # no relay in this Ray (ValueError), or Ray not reachable
        if fallback:
            configure_logging(access_log=access_log)
        return False
    if _sender is None:
        _sender = _Sender(relay)
    else:
        _sender.relay = relay
    install(RelayHandler(_sender), RelayHandler(_sender), access_log)
    return True


class RelayReader:
    """`kvgrid serve`'s side: starts the relay (``actor_options``: where it may run) and prints what it relays, on a
    thread, until ``stop``."""

    def __init__(self, actor_options: dict | None = None) -> None:
        import ray

        self.relay: Any = (  # an actor handle (mypy sees the class)
            ray.remote(LogRelay)
            .options(name=RELAY_NAME, namespace=RELAY_NAMESPACE, max_restarts=-1, **(actor_options or {"num_cpus": 0}))
            .remote()
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgrid-log-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._stop.is_set() and ray.is_initialized():
            self.read_once(READ_WAIT_S)

    def read_once(self, wait_s: float) -> None:
        import ray

        try:
            records, dropped = ray.get(self.relay.read.remote(wait_s), timeout=wait_s + SEND_TIMEOUT_S)
        except Exception:  # the relay restarts, or Ray is stopping
            self._stop.wait(1.0)
            return
        for data in records:
            try:
                record = from_dict(data)
                logging.getLogger(record.name).handle(record)
            except Exception:  # a malformed record must not stop the console
                continue
        if dropped:
            log.warning("%d log records were dropped: the console could not keep up", dropped)

    def stop(self) -> None:
        """Stop reading, then print what the actors sent until now (their last batches come within
        ``FLUSH_INTERVAL_S``)."""
        import ray

        self._stop.set()
        self._thread.join(SEND_TIMEOUT_S + READ_WAIT_S)
        if ray.is_initialized():
            time.sleep(FLUSH_INTERVAL_S * 2)
            self.read_once(0.0)


_reader: RelayReader | None = None


def start_reader(actor_options: dict | None = None) -> RelayReader:
    """Start the relay and this process's reader of it (`kvgrid serve`, once Ray runs)."""
    global _reader
    stop_reader()
    _reader = RelayReader(actor_options)
    return _reader


def stop_reader() -> None:
    """Print what is still relayed and stop reading (before Ray shuts down); nothing when no reader runs."""
    global _reader
    reader, _reader = _reader, None
    if reader is not None:
        reader.stop()
