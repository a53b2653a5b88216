"""OpenTelemetry traces of the gateway's requests: ``tracing: {otlp_endpoint: ...}`` in the serve config turns them
on (``common.config.TracingConfig``); without it nothing here is created (no provider, no exporter, no middleware)
and a request pays one context-variable read at each hook.

One trace per request, exported over OTLP/HTTP by each gateway replica (a provider of its own, never the process's
global one):

    POST /{tenant}/v1/chat/completions   the root span (SERVER): the HTTP request, from its head to its last byte
      auth                               the key check (Admission.auth)
      template                           the chat template rendered (Prompts.chat)
      tokenize                           its text tokenized (a completion's prompt too: Prompts.encode_text)
      route                              a router replica's decision: the group, the blocks it holds per tier
      queue                              the request waiting in the group's engine until first scheduled
      prefill                            its prompt computed (cached and computed tokens), up to the first token
      decode                             the rest of its output tokens

A client's W3C ``traceparent`` (and ``tracestate``) is continued: the root span is a child of the client's span,
in the client's trace; its sampled flag decides for the request (``ParentBased``), ``sample_ratio`` for requests
without one. ``queue``, ``prefill`` and ``decode`` happen in the group's engine process: it sends no spans, only
the request's ``Timings`` (offsets from its arrival, on its own monotonic clock) with the final output, and the
gateway makes the three spans from them, placed on its own clock by the time that output arrived (so no clock
difference between nodes skews them). Span attributes hold names, counts and ids, never a prompt, a completion,
a key or a query string (a Gemini client may send its key as ``?key=``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from common.config import TracingConfig
from common.outputs import RequestOutput
from router.gateway.access import PROBES

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from router.routing.router import RouteDecision

log = logging.getLogger(__name__)

SHUTDOWN_S = 2.0  # a stopping replica waits this long for its last spans to be exported
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()  # what ``traced`` is without a request trace

# The request trace of the request this task serves (set by ``TraceMiddleware``; tasks started under it inherit it).
_CURRENT: ContextVar[RequestTrace | None] = ContextVar("kvgrid_request_trace", default=None)


class Tracing:
    """A gateway replica's tracer: its own ``TracerProvider`` (sampling by ``sample_ratio`` unless the client's
    ``traceparent`` decides), a batch span processor and the OTLP/HTTP exporter to ``config.traces_url``. The batch
    processor's export delay is the SDK's (5 s; ``OTEL_BSP_SCHEDULE_DELAY`` in milliseconds sets it)."""

    def __init__(self, config: TracingConfig) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create(
            {"service.name": config.service_name, "service.instance.id": f"{socket.gethostname()}-{os.getpid()}"}
        )
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        self.exporter = OTLPSpanExporter(endpoint=config.traces_url)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer: Tracer = self.provider.get_tracer("kvgrid.gateway")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def start(cls, config: TracingConfig | None) -> Tracing | None:
        """The replica's tracing, or None (tracing off: nothing is created) without a ``tracing`` config."""
        return None if config is None else cls(config)

    def shutdown(self) -> None:
        """Export the spans still buffered (for at most ``SHUTDOWN_S``) and stop the exporter."""
        try:
            self.provider.force_flush(int(SHUTDOWN_S * 1000))
            self.provider.shutdown()
        except Exception:  # a collector that is gone must not fail the replica's stop
            log.warning("tracing: the last spans could not be exported", exc_info=True)


class RequestTrace:
    """One request's trace in the gateway: its root span and the context every other span of it is a child of."""

    __slots__ = ("tracer", "root", "context")

    def __init__(self, tracer: Tracer, root: Span, context: Context) -> None:
        self.tracer, self.root, self.context = tracer, root, context

    def annotate(self, attributes: dict[str, Any]) -> None:
        """Attributes of the request (its root span)."""
        self.root.set_attributes(attributes)

    def span(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None) -> None:
        """A finished child span of the request, from ``start_ns`` to ``end_ns`` (``time.time_ns()``); an error when
        ``attributes`` has an ``error.type``."""
        span = self.tracer.start_span(name, context=self.context, start_time=start_ns, attributes=attributes)
        if attributes and "error.type" in attributes:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=max(start_ns, end_ns))

    def route_span(
        self,
        start_ns: int,
        decision: RouteDecision | None,
        block_size: int,
        attempt: int,
        error: BaseException | None = None,
    ) -> None:
        """``route``, from ``start_ns`` to now: the group chosen and the blocks of the prompt it holds in each tier
        (GPU pool, host RAM, disk), or the error that none was (``attempt``: the groups that failed the request
        before, 0 on its first try)."""
        attributes: dict[str, Any] = {"kvgrid.attempt": attempt}
        if decision is not None:
            gpu = decision.cached_tokens - decision.host_tokens - decision.disk_tokens
            attributes.update(
                {
                    "kvgrid.group": decision.group,
                    "kvgrid.route.cached_tokens": decision.cached_tokens,
                    "kvgrid.route.matched_blocks.gpu": max(0, gpu) // block_size,
                    "kvgrid.route.matched_blocks.host": decision.host_tokens // block_size,
                    "kvgrid.route.matched_blocks.disk": decision.disk_tokens // block_size,
                }
            )
        if error is not None:
            attributes["error.type"] = _error_type(error)
        self.span("route", start_ns, time.time_ns(), attributes)

    @contextlib.contextmanager
    def live(self, name: str) -> Iterator[Span]:
        """A child span of the request from now to the end of the ``with`` block; an exception ends it as an error
        (its type only: an error message may quote the request)."""
        from opentelemetry.trace import Status, StatusCode

        span = self.tracer.start_span(name, context=self.context)
        try:
            yield span
        except BaseException as exc:
            span.set_attribute("error.type", _error_type(exc))
            span.set_status(Status(StatusCode.ERROR))
            raise
        finally:
            span.end()

    def chat_spans(self, marks: list[int], prompt_tokens: int | None) -> None:
        """``template`` and ``tokenize`` from the marks ``Prompts.chat`` took (start, template rendered, tokenized);
        a template that failed has only its start: ``template`` ends now."""
        now = time.time_ns()
        rendered = marks[1] if len(marks) > 1 else now
        self.span("template", marks[0], rendered)
        if len(marks) > 2:
            self.span("tokenize", rendered, marks[2], {"kvgrid.prompt_tokens": prompt_tokens or 0})

    def group_spans(self, group: str, finals: list[tuple[int, RequestOutput]]) -> None:
        """``queue``, ``prefill`` and ``decode`` of a request that ``group`` ran, from the final output of each of its
        choices and when it arrived here (``time.time_ns()``): the engine's ``Timings`` are offsets from the
        request's arrival there, placed so that the last choice's end is when its final output arrived."""
        timed = [(at, out, out.timings) for at, out in finals if out.timings is not None]
        if not timed:
            return
        at, _, last = max(timed, key=lambda x: x[0])
        arrived = at - round(last.finished * 1e9)

        def ns(offset: float) -> int:
            return arrived + round(offset * 1e9)

        scheduled = min((t.scheduled for _, _, t in timed if t.scheduled is not None), default=None)
        first_token = min((t.first_token for _, _, t in timed if t.first_token is not None), default=None)
        finished = max(t.finished for _, _, t in timed)
        first = min((out for _, out, _ in timed), key=lambda o: o.index)
        prompt, cached = first.num_prompt_tokens, first.num_cached_tokens
        self.span("queue", arrived, ns(finished if scheduled is None else scheduled), {"kvgrid.group": group})
        if scheduled is None:
            return
        self.span(
            "prefill",
            ns(scheduled),
            ns(finished if first_token is None else first_token),
            {
                "kvgrid.group": group,
                "kvgrid.prompt_tokens": prompt,
                "kvgrid.cached_tokens": cached,
                "kvgrid.computed_tokens": max(0, prompt - cached),
            },
        )
        if first_token is None:
            return
        self.span(
            "decode",
            ns(first_token),
            ns(finished),
            {
                "kvgrid.group": group,
                "kvgrid.output_tokens": sum(len(out.token_ids) for _, out, _ in timed),
                "kvgrid.choices": len(timed),
                "kvgrid.finish_reason": str(first.finish_reason or ""),
            },
        )


def current_trace() -> RequestTrace | None:
    """The trace of the request this task serves; None when tracing is off, the request is not sampled, or its
    response has ended (background work a request started inherits its context: it is not part of its trace)."""
    rt = _CURRENT.get()
    return None if rt is None or not rt.root.is_recording() else rt


def traced(name: str) -> contextlib.AbstractContextManager[Span | None]:
    """A child span ``name`` of the current request over a ``with`` block (``RequestTrace.live``); without a request
    trace a shared no-op (yields None)."""
    rt = current_trace()
    return _NO_SPAN if rt is None else rt.live(name)


def _error_type(exc: BaseException) -> str:
    status = getattr(exc, "status", None)  # an ApiError: its HTTP status says more than its class
    return f"{type(exc).__name__} {status}" if isinstance(status, int) else type(exc).__name__


class TraceMiddleware:
    """The ASGI middleware that makes each HTTP request's root span (``create_app`` adds it when tracing is on):
    named by the method and the route's template (``POST /{tenant}/v1/chat/completions``), a child of the client's
    ``traceparent`` when it sent one, with the response's status and its ``X-Request-Id`` (router/gateway/access.py
    answers one on every response: added after its middleware, this one is outside it and sees it). The request's
    handlers find it with ``current_trace``."""

    def __init__(self, app: Any, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in PROBES:  # load balancers' probes: no trace each
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        tr = self.tracing
        headers = scope.get("headers") or ()
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in _TRACE_HEADERS}
        parent = tr.propagator.extract(carrier) if carrier else None
        method = scope.get("method", "GET")
        root = tr.tracer.start_span(
            method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope.get("path", ""), "url.scheme": "http"},
        )
        if not root.is_recording():  # not sampled: no spans for this request
            root.end()
            await self.app(scope, receive, send)
            return
        request_id: bytes | None = None  # the response's X-Request-Id (router/gateway/access.py's, inside this)
        status: int | None = None

        async def send_traced(message: dict) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                for k, v in message.get("headers") or ():
                    if k.lower() == b"x-request-id":
                        request_id = v
            await send(message)

        token = _CURRENT.set(RequestTrace(tr.tracer, root, set_span_in_context(root)))
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            root.set_attribute("error.type", _error_type(exc))
            if status is None:
                status = 500
            raise
        finally:
            _CURRENT.reset(token)
            route = getattr(scope.get("route"), "path", None)  # the matched route's template (FastAPI sets it)
            if isinstance(route, str):
                root.update_name(f"{method} {route}")
                root.set_attribute("http.route", route)
            if request_id:
                root.set_attribute("kvgrid.request_id", request_id.decode("latin-1")[:128])
            if status is not None:
                root.set_attribute("http.response.status_code", status)
                if status >= 500:
                    root.set_status(Status(StatusCode.ERROR))
            root.end()
