"""OpenTelemetry tracing (router/gateway/tracing.py): off without a ``tracing`` config (no provider,
no exporter); with one, a request's spans (gateway, auth, template, tokenize, route, queue, prefill, decode) reach
an OTLP/HTTP collector in one trace, the client's, and hold no prompt text and no key.

The collector is a tiny HTTP server in this process that decodes ``ExportTraceServiceRequest`` bodies (the
``opentelemetry-proto`` package the exporter itself uses: tests/otlp_collector.py, one for the session); the server
is a real ``kvgrid serve``, the one the modules on one worker group share (tests/conftest.py's ``one_group_server``)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import pytest

from common.config import ServeConfig, TracingConfig
from common.outputs import FinishReason, RequestOutput, Timings
from harness import ACME_KEY, oa, wait_for
from otlp_collector import Collector
from router.gateway.tracing import RequestTrace, Tracing

# The spans of one chat completion, by name (the root's is its method and route).
ROOT = "POST /{tenant}/v1/chat/completions"
NAMES = {ROOT, "auth", "template", "tokenize", "route", "queue", "prefill", "decode"}


# -- off by default -----------------------------------------------------------------------------------------------


def test_no_tracing_config_creates_no_provider_and_no_exporter(demo_path, redis_client, monkeypatch) -> None:
    """Without ``tracing`` a gateway creates no tracer provider, no exporter and no middleware; the config's
    ``tracing`` section alone turns them on (the same gateway code, once each)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider

    from router.gateway.app import create_app
    from router.gateway.core import Gateway
    from router.gateway.store import KeyRing
    from router.gateway.tracing import TraceMiddleware

    made: list[str] = []
    for cls in (TracerProvider, OTLPSpanExporter):
        init = cls.__init__

        def counted(self, *args, _init=init, _name=cls.__name__, **kw) -> None:
            made.append(_name)
            _init(self, *args, **kw)

        monkeypatch.setattr(cls, "__init__", counted)

    def gateway(extra: dict[str, Any]):
        config = ServeConfig.model_validate(
            {"model": str(demo_path), "tenants": [{"name": "acme", "api_keys": [ACME_KEY]}], **extra}
        )
        assert (config.tracing is None) == (not extra)
        return Gateway(
            config, KeyRing.from_config(config), str(demo_path), [None], f"unix://{redis_client.socket_file}"
        )

    async def closed(gw) -> None:
        await gw.close()

    gw = gateway({})
    app = create_app(gw)
    assert gw.tracing is None and made == []
    assert not any(m.cls is TraceMiddleware for m in app.user_middleware)
    asyncio.run(closed(gw))
    assert made == []

    gw = gateway({"tracing": {"otlp_endpoint": "http://127.0.0.1:9/"}})  # nothing listens: nothing is sent either
    app = create_app(gw)
    assert gw.tracing is not None and sorted(made) == ["OTLPSpanExporter", "TracerProvider"]
    assert any(m.cls is TraceMiddleware for m in app.user_middleware)
    assert gw.tracing.exporter._endpoint == "http://127.0.0.1:9/v1/traces"
    asyncio.run(closed(gw))


def test_tracing_config_checks_the_endpoint() -> None:
    assert TracingConfig(otlp_endpoint="http://collector:4318").traces_url == "http://collector:4318/v1/traces"
    assert TracingConfig(otlp_endpoint="https://c/v1/traces").traces_url == "https://c/v1/traces"
    for bad in ("collector:4318", "ftp://collector", "http://", "http://c:4318/?key=x"):
        with pytest.raises(ValueError):
            TracingConfig(otlp_endpoint=bad)
    with pytest.raises(ValueError):
        TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=1.5)


def test_group_spans_place_the_engine_timings_on_the_gateway_clock() -> None:
    """``queue``, ``prefill`` and ``decode`` follow each other without gap and end when the final output came; n > 1:
    one set for the request, over all its choices."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import set_span_in_context

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    root = tracer.start_span("root")
    rt = RequestTrace(tracer, root, set_span_in_context(root))

    def final(index: int, tokens: int, timings: Timings) -> RequestOutput:
        ids = list(range(tokens))
        return RequestOutput(
            "r", "acme", list(range(40)), ids, "", [], "", True, FinishReason.STOP, 32, index=index, timings=timings
        )

    at = 10_000_000_000
    rt.group_spans(
        "group-0",
        [
            (at - 2_000_000, final(1, 3, Timings(0.25, 0.5, 0.998))),
            (at, final(0, 5, Timings(0.25, 0.5, 1.0))),
        ],
    )
    root.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    q, p, d = spans["queue"], spans["prefill"], spans["decode"]
    assert (q.start_time, q.end_time) == (at - 1_000_000_000, at - 750_000_000)
    assert (p.start_time, p.end_time) == (q.end_time, at - 500_000_000)
    assert (d.start_time, d.end_time) == (p.end_time, at)
    assert dict(p.attributes or {}) == {
        "kvgrid.group": "group-0",
        "kvgrid.prompt_tokens": 40,
        "kvgrid.cached_tokens": 32,
        "kvgrid.computed_tokens": 8,
    }
    assert (
        d.attributes is not None and d.attributes["kvgrid.output_tokens"] == 8 and d.attributes["kvgrid.choices"] == 2
    )
    assert all(s.parent is not None and s.parent.span_id == root.get_span_context().span_id for s in (q, p, d))

    exporter.clear()  # a request failed before its first token: no decode span
    rt.group_spans("group-0", [(at, final(0, 0, Timings(0.25, None, 0.5)))])
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["prefill", "queue"]
    provider.shutdown()


def test_tracing_start_without_config_is_none() -> None:
    assert Tracing.start(None) is None


# -- a real server ------------------------------------------------------------------------------------------------


@pytest.fixture()
def collector(otlp_collector: Collector) -> Collector:
    return otlp_collector


@pytest.fixture()
def server(one_group_server):
    # The server test_health shares too (harness.one_group_body: one group, tracing to the session's collector with
    # the spans exported every 0.2 s). Every test here sends its own trace ids and markers, and looks at its own
    # traces only; no span of any request may hold a key.
    return one_group_server


def test_a_request_is_one_trace_continuing_the_clients(server, collector: Collector) -> None:
    marker = f"MARKER{secrets.token_hex(6)}"
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    client = oa(server)
    sent = time.time_ns()
    raw = client.chat.completions.with_raw_response.create(
        model="demo",
        messages=[
            {"role": "system", "content": f"You answer questions about {marker} in one line."},
            {"role": "user", "content": f"What is {marker}? Tell me all about {marker}."},
        ],
        max_tokens=8,
        temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    done = time.time_ns()
    reply = raw.parse()
    assert reply.usage is not None

    def complete() -> list[dict[str, Any]] | None:
        spans = collector.trace(trace_id)
        return spans if NAMES <= {s["name"] for s in spans} else None

    try:
        spans = wait_for(complete, 60, "the request's spans at the collector", interval_s=0.2)
    except AssertionError:
        got = sorted(s["name"] for s in collector.trace(trace_id))
        raise AssertionError(f"spans of the trace: {got}; of all traces: {len(collector.spans)}") from None
    by_name = {s["name"]: s for s in spans}
    assert len(spans) == len(NAMES), sorted(s["name"] for s in spans)  # one of each, no stray span in the trace

    # One trace, the client's: the root is a child of the client's span, every other span a child of the root.
    root = by_name[ROOT]
    assert root["parent"] == parent_id
    assert all(s["parent"] == root["span_id"] for s in spans if s is not root)
    assert root["resource"]["service.name"] == "kvgrid-test"

    # Times: the root spans the request; the group's spans follow each other, after routing and within the root.
    slack = 50_000_000  # 50 ms: clocks read at slightly different points
    assert sent - slack <= root["start"] <= root["end"] <= done + slack
    for s in spans:
        assert root["start"] - slack <= s["start"] <= s["end"] <= root["end"] + slack, s["name"]
    q, p, d = by_name["queue"], by_name["prefill"], by_name["decode"]
    assert q["end"] == p["start"] and p["end"] == d["start"]
    assert by_name["auth"]["end"] <= by_name["template"]["start"] <= by_name["tokenize"]["start"]
    assert by_name["tokenize"]["end"] <= by_name["route"]["start"] and by_name["route"]["end"] <= q["start"] + slack

    # Attributes: the request's names and counts.
    attrs = root["attributes"]
    assert attrs["http.route"] == "/{tenant}/v1/chat/completions" and attrs["http.request.method"] == "POST"
    assert attrs["http.response.status_code"] == 200 and attrs["kvgrid.tenant"] == "acme"
    request_id = raw.headers.get("x-request-id")
    if request_id is not None:  # the gateway's request id (X-Request-Id), where the gateway answers one
        assert attrs["kvgrid.request_id"] == request_id
    route = by_name["route"]["attributes"]
    assert route["kvgrid.group"] and route["kvgrid.attempt"] == 0
    assert {
        "kvgrid.route.matched_blocks.gpu",
        "kvgrid.route.matched_blocks.host",
        "kvgrid.route.matched_blocks.disk",
    } <= set(route)
    prefill = p["attributes"]
    assert prefill["kvgrid.prompt_tokens"] == reply.usage.prompt_tokens
    assert prefill["kvgrid.cached_tokens"] + prefill["kvgrid.computed_tokens"] == reply.usage.prompt_tokens
    assert d["attributes"]["kvgrid.output_tokens"] == reply.usage.completion_tokens
    assert by_name["tokenize"]["attributes"]["kvgrid.prompt_tokens"] == reply.usage.prompt_tokens
    assert q["attributes"]["kvgrid.group"] == route["kvgrid.group"]

    # No prompt text, completion text or key anywhere in what was exported (every body, not only these spans).
    completion = reply.choices[0].message.content or ""
    with collector.lock:
        bodies = b"".join(collector.bodies)
    assert marker.encode() not in bodies and ACME_KEY.encode() not in bodies
    if len(completion.strip()) >= 8:
        assert completion.strip().encode() not in bodies
    for s in collector.spans:
        for value in [
            *s["attributes"].values(),
            *s["resource"].values(),
            *(v for e in s["events"] for v in e.values()),
        ]:
            assert marker not in str(value) and ACME_KEY not in str(value), (s["name"], value)


def test_a_streamed_request_has_the_same_spans_and_an_unsampled_one_none(server, collector: Collector) -> None:
    """A streamed answer's trace ends with its stream; a client's ``traceparent`` that is not sampled (flags 00)
    is respected: its request exports nothing."""
    client = oa(server)
    unsampled, sampled = secrets.token_hex(16), secrets.token_hex(16)
    for trace_id, flags in ((unsampled, "00"), (sampled, "01")):
        stream = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": f"Stream {secrets.token_hex(4)}, please."}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    spans = wait_for(
        lambda: (s := collector.trace(sampled)) and NAMES <= {x["name"] for x in s} and s,
        60,
        "the streamed request's spans",
        interval_s=0.2,
    )
    by_name = {s["name"]: s for s in spans}
    assert all(s["parent"] == by_name[ROOT]["span_id"] for s in spans if s["name"] != ROOT)
    assert by_name["decode"]["end"] <= by_name[ROOT]["end"]
    assert usage and by_name["decode"]["attributes"]["kvgrid.output_tokens"] == usage[0].completion_tokens
    time.sleep(1)  # the unsampled request ended first: anything of it would have been exported by now
    assert collector.trace(unsampled) == []
