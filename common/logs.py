"""Logging set-up shared by the CLI and the long-lived actors (the supervisor, whose messages an operator reads
in `kvgrid serve`'s output, and the gateway replicas, whose access log goes there too): kvgrid's own loggers from
INFO, other libraries' from WARNING (httpx logs every request at INFO); diagnostics to stderr, the access log
(logger ``kvgrid.access``, one line per HTTP request) to stdout.

Two formats (``logging.format`` of the serve config): ``text``, a readable line per record with the fields of a
structured record (the access log's) as ``key=value`` after its message, and ``json``, one JSON object per line
(``time``, ``level``, ``logger``, ``message``, then the fields). A record logged while a request is served
carries its ``request_id`` (the ``X-Request-Id`` of the response, router/gateway/access.py).

Ray actors do not print to the console of `kvgrid serve` (Ray keeps their output in its log folder): their records
travel to it through the log relay (common/log_relay.py), which formats them there, in the configured format."""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
KVGRID_LOGGERS = ("router", "worker", "common", "kvgrid")
ACCESS_LOGGER = "kvgrid.access"  # one record per HTTP request (router/gateway/access.py), to stdout

LogFormat = Literal["text", "json"]

# The id of the request this task serves (set by the gateway's access log middleware): every record logged while
# it runs carries it.
REQUEST_ID: ContextVar[str | None] = ContextVar("kvgrid_request_id", default=None)

_installed: dict[str, logging.Handler] = {}  # "root" and "access": the handlers configure_logging installed


class RequestIdFilter(logging.Filter):
    """Stamps a record with the id of the request being served where it was logged (unless it has one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


class TextFormatter(logging.Formatter):
    """``LOG_FORMAT``, then the record's ``fields`` (a dict: the access log's; but those its ``inline`` names, which
    its message shows) and its request id as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            inline = getattr(record, "inline", ())  # shown in the message already
            line += "".join(f" {k}={_text(v)}" for k, v in fields.items() if k not in inline)
        rid = getattr(record, "request_id", None)
        if rid is not None and not (fields and "request_id" in fields):
            line += f" request_id={rid}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, the
    request id if any, the record's ``fields``, and ``exception`` (a traceback's text) if it has one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if fields:
            out.update(fields)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


def formatter(fmt: LogFormat = "text") -> logging.Formatter:
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: expected 'text' or 'json'")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def install(root_handler: logging.Handler, access_handler: logging.Handler, access_log: bool = True) -> None:
    """Make ``root_handler`` the one handler kvgrid installed on the root logger (replacing an earlier one of its
    own; another's is left alone) and ``access_handler`` the access logger's; kvgrid's loggers log from INFO, the
    access logger only when ``access_log``."""
    for handler in (root_handler, access_handler):
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    old = _installed.get("root")
    if old is not None and old is not root_handler:
        root.removeHandler(old)
    if root_handler not in root.handlers:
        root.addHandler(root_handler)
    if old is None:  # the first time: other libraries from WARNING (an operator's later choice is kept)
        root.setLevel(logging.WARNING)
    _installed["root"] = root_handler
    access = logging.getLogger(ACCESS_LOGGER)
    old = _installed.get("access")
    if old is not None and old is not access_handler:
        access.removeHandler(old)
    if access_handler not in access.handlers:
        access.addHandler(access_handler)
    _installed["access"] = access_handler
    access.propagate = False  # stdout only, never also the diagnostics on stderr
    access.disabled = not access_log
    for name in KVGRID_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    access.setLevel(logging.INFO)


def configure_logging(fmt: LogFormat = "text", access_log: bool = True) -> None:
    """Records to this process's stderr (the access log to stdout), in ``fmt``. Called again (the CLI first, then
    `kvgrid serve` with its config's format), it changes the format of its own handlers, never adds more; a root
    logger that another library configured first is left alone (its handlers print kvgrid's records)."""
    root = logging.getLogger()
    previous = _installed.get("root")
    if previous is None and root.handlers:
        for name in KVGRID_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)
        return
    form = formatter(fmt)
    err = _stream_handler(previous, sys.stderr, sys.__stderr__, form=form)
    out = _stream_handler(_installed.get("access"), sys.stdout, sys.__stdout__, form=form)
    install(err, out, access_log)


def _stream_handler(previous: logging.Handler | None, *streams: Any, form: logging.Formatter) -> logging.Handler:
    """``previous`` with ``form`` when it is a stream handler on one of ``streams`` (a second configure_logging
    keeps it), else a new handler on the first of them."""
    if isinstance(previous, logging.StreamHandler) and previous.stream in streams:
        previous.setFormatter(form)
        return previous
    handler = logging.StreamHandler(streams[0])
    handler.setFormatter(form)
    return handler
