"""tests/otlp.py's Receiver, fed by the real OTLP/HTTP exporter over a real HTTP round
trip: what the tracing tests read from it is what the SDK sent."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tests import otlp


@pytest.fixture
def receiver() -> Iterator[otlp.Receiver]:
    with otlp.Receiver() as receiver:
        yield receiver


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_exported_spans_arrive_with_their_parent_kind_links_and_attributes(
    receiver: otlp.Receiver, compression: Compression
) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "unit"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=receiver.endpoint + "/v1/traces", compression=compression)))
    tracer = provider.get_tracer("tests.unit.otlp")
    try:
        with tracer.start_as_current_span("origin") as origin:
            pass
        with (
            tracer.start_as_current_span(
                "parent", kind=trace.SpanKind.PRODUCER,
                attributes={"s": "x", "i": 7, "f": 1.5, "b": True, "a": ["p", "q"]}) as parent,
            tracer.start_as_current_span(
                "child", kind=trace.SpanKind.CONSUMER,
                links=[trace.Link(origin.get_span_context(), {"why": "origin"})]),
        ):
            pass
        assert provider.force_flush()
    finally:
        provider.shutdown()

    def both(spans: list[otlp.Span]) -> dict[str, otlp.Span] | None:
        named = {s.name: s for s in spans}
        return named if {"parent", "child"} <= named.keys() else None

    named = receiver.wait_for(both, timeout=10, what="the parent and the child")
    parent_span, child = named["parent"], named["child"]
    assert parent_span.trace_id == format(parent.get_span_context().trace_id, "032x")
    assert parent_span.span_id == format(parent.get_span_context().span_id, "016x")
    assert (len(parent_span.trace_id), len(parent_span.span_id)) == (32, 16)
    assert parent_span.parent_span_id is None
    assert (child.trace_id, child.parent_span_id) == (parent_span.trace_id, parent_span.span_id)
    assert (parent_span.kind, child.kind) == ("PRODUCER", "CONSUMER")
    assert parent_span.service == child.service == "unit"
    assert parent_span.scope == "tests.unit.otlp"
    assert parent_span.attributes == {"s": "x", "i": 7, "f": 1.5, "b": True, "a": ("p", "q")}
    origin_span = named["origin"]
    assert origin_span.trace_id != parent_span.trace_id
    assert child.links == (otlp.Link(origin_span.trace_id, origin_span.span_id,
                                     {"why": "origin"}),)
    assert parent_span.start_ns <= child.start_ns <= child.end_ns <= parent_span.end_ns
    assert receiver.trace(parent_span.trace_id) == [parent_span, child]
    assert receiver.by_name("chi") == [child]
    assert not receiver.errors


def test_metrics_and_logs_are_answered_and_ignored(receiver: otlp.Receiver) -> None:
    for path in ("/v1/metrics", "/v1/logs"):
        request = urllib.request.Request(
            receiver.endpoint + path, data=b"", method="POST",
            headers={"Content-Type": otlp.PROTOBUF})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
    assert receiver.spans == [] and receiver.errors == []


def test_a_wait_that_times_out_says_what_arrived(receiver: otlp.Receiver) -> None:
    receiver.add([otlp.Span("ab" * 16, "cd" * 8, None, "seen", "INTERNAL", "svc", {}, (), 1, 2)])
    with pytest.raises(AssertionError) as raised:
        receiver.wait_for(lambda spans: None, timeout=0.05, what="nothing")
    assert "waiting for nothing; 1 span(s) received" in str(raised.value)
    assert "seen [INTERNAL] service=svc trace=abababab" in str(raised.value)


def test_env_names_the_installed_http_exporter(receiver: otlp.Receiver) -> None:
    from importlib.metadata import entry_points

    env = receiver.env("worker")
    names = {e.name for e in entry_points(group="opentelemetry_traces_exporter")}
    assert env["OTEL_TRACES_EXPORTER"] in names
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://127.0.0.1:{receiver.port}"
    assert env["OTEL_SERVICE_NAME"] == "worker"
