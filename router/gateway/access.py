"""Request ids and the access log of a gateway replica: an ASGI middleware around the whole app (every tenant's
APIs, the admin API, the health probes).

Every response carries ``X-Request-Id``: the client's own when it sent a sane one (1-128 printable ASCII characters,
no spaces), else a new one (a uuid4 in hex). While the request is served the id is ``common.logs.REQUEST_ID`` (every
record logged meanwhile carries it) and the request's ``Access`` record is ``ACCESS``: the gateway fills in the
tenant and model once the key is accepted (``Admission.auth``), the token counts once the usage is accounted
(``Accounting.account``) and the time to the first token (``Generation.generate``).

When the response has ended, one record goes to the logger ``kvgrid.access`` (``logging.access_log``, on by
default): request id, method, path (the tenant's name is in it; never the query string, which may hold a Gemini
``key``), tenant, model, status, prompt / cached / output tokens, TTFT and total time in ms. Never a header's
value (a key, an Authorization header), a prompt or a completion. A health probe that answered 200 is not logged
(load balancers probe every few seconds)."""

from __future__ import annotations

import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from common.logs import ACCESS_LOGGER, REQUEST_ID

HEADER = b"x-request-id"
MAX_ID_CHARS = 128
MAX_PATH_CHARS = 512
PROBES = frozenset({"/health", "/ready", "/-/healthz"})
INLINE = ("method", "path", "status")  # fields the text line has in its message already

access_log = logging.getLogger(ACCESS_LOGGER)


@dataclass(slots=True)
class Access:
    """What the access log says of one request; the gateway fills it in as the request is served."""

    request_id: str
    start: float  # time.perf_counter() when the request came in
    tenant: str | None = None
    model: str | None = None
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None  # from ``start`` to the first output token

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.start

    def usage(self, prompt: int, cached: int, output: int) -> None:
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.output_tokens += output


ACCESS: ContextVar[Access | None] = ContextVar("kvgrid_access", default=None)


def current() -> Access | None:
    """The access record of the request this task serves (None outside a request: background work)."""
    return ACCESS.get()


def _sane(value: bytes) -> str | None:
    if 0 < len(value) <= MAX_ID_CHARS and all(0x21 <= c <= 0x7E for c in value):
        return value.decode("ascii")
    return None


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` if it is sane, else a new id."""
    for name, value in headers:
        if name.lower() == HEADER:
            rid = _sane(value)
            if rid is not None:
                return rid
            break
    return uuid.uuid4().hex


def _printable(raw: str, limit: int) -> str:
    """``raw`` with every character outside printable ASCII (spaces, line breaks, ...) percent-encoded, cut at
    ``limit``: a log line holds exactly one request."""
    out = "".join(c if 0x21 <= ord(c) <= 0x7E else "".join(f"%{b:02X}" for b in c.encode()) for c in raw)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def log_path(scope: dict[str, Any]) -> str:
    """The request's path as the client sent it (percent-encoded), without its query string."""
    raw = scope.get("raw_path")
    text = raw.decode("latin-1") if isinstance(raw, bytes) else scope.get("path", "")
    return _printable(text.split("?", 1)[0], MAX_PATH_CHARS)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class AccessLog:
    """The ASGI middleware (``create_app`` puts it around the whole gateway app)."""

    def __init__(self, app: Any, enabled: bool = True) -> None:
        self.app, self.enabled = app, enabled

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope.get("headers") or [])
        record = Access(rid, time.perf_counter())
        header = (HEADER, rid.encode("ascii"))
        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        access_token, rid_token = ACCESS.set(record), REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if not started and type(exc).__name__ != "ClientDisconnect":
                # Starlette's last-resort handler (outside this middleware) would answer without the id.
                record.status = 500
                body = b'{"error": {"message": "internal server error", "type": "api_error", "code": 500}}'
                await send_with_id(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
                    }
                )
                await send({"type": "http.response.body", "body": body, "more_body": False})
            elif not started:
                record.status = 499  # the client went away before an answer
            raise
        except BaseException:  # cancelled: the server is stopping or the client left
            if not started:
                record.status = 499
            raise
        finally:
            ACCESS.reset(access_token)
            REQUEST_ID.reset(rid_token)
            if self.enabled and not (record.status == 200 and scope.get("path") in PROBES):
                self._log(scope, record)

    @staticmethod
    def _log(scope: dict[str, Any], r: Access) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        method = _printable(str(scope.get("method", "-")), 16)
        path = log_path(scope)
        access_log.info(
            "%s %s %d",
            method,
            path,
            r.status,
            extra={
                "request_id": r.request_id,
                "inline": INLINE,
                "fields": {
                    "request_id": r.request_id,
                    "method": method,
                    "path": path,
                    "tenant": r.tenant,
                    "model": r.model,
                    "status": r.status,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "output_tokens": r.output_tokens,
                    "ttft_ms": _ms(r.ttft_s),
                    "total_ms": _ms(time.perf_counter() - r.start),
                },
            },
        )
