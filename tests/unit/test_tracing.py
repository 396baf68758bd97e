"""The tracing decisions of drain.daemon.tracing and drain.trace_context, on the
SDK's in-memory exporter: which trace a message joins, what it links to, which
headers it carries, and what a malformed ``trace`` column costs (nothing but
that job's context)."""

from __future__ import annotations

import datetime as dt
import json
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import baggage, context, trace
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Histogram

from drain import trace_context
from drain.daemon import tracing
from drain.postgres.rows import StagedRow

pytestmark = pytest.mark.fast

NOW = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.timezone.utc)
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    made = TracerProvider()
    made.add_span_processor(SimpleSpanProcessor(exporter))
    yield made, exporter
    made.shutdown()


def _row(trace_json: str | None, *, staged_ago: float = 1.0, row_id: int = 1,
         delayed_by: float = 0.0) -> StagedRow:
    staged_at = NOW.timestamp() - staged_ago
    return StagedRow(
        id=row_id, task_id=uuid.UUID(int=row_id), task_name="t.x", args_json="[]",
        kwargs_json="{}", queue="q", trace_json=trace_json,
        staged_epoch=None if trace_json is None else staged_at,
        due_epoch=staged_at + delayed_by)


def _carrier(**extra: Any) -> str:
    return json.dumps({"traceparent": PARENT, **extra})


def _message(t: tracing.Tracing, row: StagedRow) -> tracing.Traced | None:
    traced = t.message(row, None, NOW.timestamp())
    if traced is not None:
        t.sent(traced, 42)
    return traced


def test_carrier_keeps_only_what_a_worker_can_use() -> None:
    assert tracing.carrier(None) is None
    assert tracing.carrier(_carrier(tracestate="a=1", baggage="k=v", other="x")) == {
        "traceparent": PARENT, "tracestate": "a=1", "baggage": "k=v"}
    assert tracing.carrier(_carrier(**{"drain.link": "requeued"}))[  # type: ignore[index]
        "drain.link"] == "requeued"
    for bad in ("00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case
                "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff
                "00-00000000000000000000000000000000-b7ad6b7169203331-01",
                "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
                PARENT + "\n", PARENT[:-1], " " + PARENT):
        assert tracing.carrier(json.dumps({"traceparent": bad})) is None, bad
    # Beyond the W3C limits: left out, the rest kept.
    assert tracing.carrier(_carrier(tracestate="a=" + "x" * 600, baggage="k=" + "v" * 9000)) == {
        "traceparent": PARENT}
    assert tracing.carrier(json.dumps({"traceparent": 7, "baggage": ["k=v"]})) is None
    assert tracing.carrier('"text"') is None
    assert tracing.carrier(json.dumps({"drain.link": "requeued"})) is None


def test_carrier_survives_whatever_sql_can_store() -> None:
    """Random JSON objects, the kind a plain INSERT can put in the column: never an
    exception, only the three headers as short strings."""
    rng = random.Random(29)
    pieces: list[Any] = [None, True, 0, -1, 1e300, "", "x" * 10_000, "é\u2028", [], {},
                         {"traceparent": PARENT}, PARENT, PARENT.upper(), "k=v,k2=v2"]
    keys = ["traceparent", "tracestate", "baggage", "drain.link", "", "TRACEPARENT", "x"]
    for _ in range(3000):
        value = {rng.choice(keys): rng.choice(pieces) for _ in range(rng.randrange(5))}
        kept = tracing.carrier(json.dumps(value))
        if kept is None:
            continue
        assert set(kept) <= {"traceparent", "tracestate", "baggage", "drain.link"}
        assert all(isinstance(v, str) for v in kept.values())
        assert len(kept.get("baggage", "").encode()) <= tracing.MAX_BAGGAGE
        assert len(kept.get("tracestate", "").encode()) <= tracing.MAX_TRACESTATE


def test_without_the_sdk_child_forwards_the_staging_headers() -> None:
    t = tracing.Tracing("child", 300.0)
    assert _message(t, _row(None)) is None  # the fast path: nothing to do
    traced = _message(t, _row(_carrier(tracestate="a=1", other="x")))
    assert traced is not None and traced.headers == {"traceparent": PARENT, "tracestate": "a=1"}
    # A new trace is wanted, and there is no span to link from: no headers.
    assert _message(t, _row(_carrier(), staged_ago=301.0)) is None
    assert _message(t, _row(_carrier(**{"drain.link": "requeued"}))) is None
    assert _message(tracing.Tracing("link", 300.0), _row(_carrier())) is None
    assert _message(tracing.Tracing("none", 300.0), _row(_carrier())) is None


def _spans(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_child_continues_the_staging_trace(
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    made, exporter = provider
    t = tracing.Tracing("child", 300.0, made.get_tracer("t"))
    row = _row(_carrier(baggage="user=42"), delayed_by=0.5)
    t.begin_batch([row])
    traced = _message(t, row)
    registry = CollectorRegistry()
    waits = Histogram("w", "w", registry=registry)
    t.end_batch(1, waits)
    spans = _spans(exporter)
    publish, batch = spans["publish q"], spans["drain batch"]
    assert publish.kind == trace.SpanKind.PRODUCER
    assert format(publish.context.trace_id, "032x") == PARENT[3:35]
    assert format(publish.parent.span_id, "016x") == PARENT[36:52]
    assert publish.attributes["messaging.message.id"] == str(uuid.UUID(int=1))
    assert publish.attributes["messaging.message.body.size"] == 42
    assert publish.attributes["drain.job.waited_seconds"] == pytest.approx(0.5)
    assert not publish.links
    # The headers name the publish span, and the baggage goes on.
    assert traced is not None and traced.headers is not None
    assert traced.headers["traceparent"] == (
        f"00-{PARENT[3:35]}-{publish.context.span_id:016x}-01")
    assert traced.headers["baggage"] == "user=42"
    assert [link.context.span_id for link in batch.links] == [publish.context.span_id]
    assert batch.context.trace_id != publish.context.trace_id
    # The exemplar is the job's sampled trace.
    sample = next(s for m in registry.collect() for s in m.samples if s.exemplar is not None)
    assert sample.exemplar is not None
    assert sample.exemplar.labels == {"trace_id": PARENT[3:35]}


@pytest.mark.parametrize(("mode", "row", "reason"), [
    ("link", _row(_carrier()), "link"),
    ("child", _row(_carrier(), staged_ago=301.0), "waited"),
    ("child", _row(_carrier(**{"drain.link": "requeued"})), "requeued"),
    ("none", _row(_carrier()), None),
    ("child", _row(None), None),
    ("child", _row(json.dumps({"traceparent": "garbage"})), None),
])
def test_a_new_trace_links_to_the_staging_context_where_it_should(
    provider: tuple[TracerProvider, InMemorySpanExporter], mode: str, row: StagedRow,
    reason: str | None,
) -> None:
    made, exporter = provider
    t = tracing.Tracing(mode, 300.0, made.get_tracer("t"))
    traced = _message(t, row)
    publish = _spans(exporter)["publish q"]
    assert publish.parent is None  # the root of a new trace
    assert format(publish.context.trace_id, "032x") != PARENT[3:35]
    if reason is None:
        assert not publish.links
    else:
        (link,) = publish.links
        assert format(link.context.trace_id, "032x") == PARENT[3:35]
        assert format(link.context.span_id, "016x") == PARENT[36:52]
        assert link.attributes == {"drain.link.reason": reason}
    assert traced is not None and traced.headers is not None
    assert traced.headers["traceparent"][3:35] == format(publish.context.trace_id, "032x")


@pytest.mark.parametrize(("sampler", "flags", "span_made"), [
    (sampling.ParentBased(sampling.ALWAYS_ON), "00", False),
    (sampling.ParentBased(sampling.ALWAYS_ON), "01", True),
    (sampling.ParentBased(sampling.TraceIdRatioBased(0.01)), "02", False),
    (sampling.ALWAYS_ON, "00", True),
])
def test_a_parent_based_sampler_spares_the_unsampled_their_span(
    sampler: sampling.Sampler, flags: str, span_made: bool,
) -> None:
    """Under a parent-based sampler a job staged by an unsampled request would get a
    span only to drop it: its headers go on as they are, no span is made."""
    exporter = InMemorySpanExporter()
    made = TracerProvider(sampler=sampler)
    made.add_span_processor(SimpleSpanProcessor(exporter))
    parent = PARENT[:-2] + flags
    t = tracing.Tracing("child", 300.0, made.get_tracer("t"))
    traced = _message(t, _row(json.dumps({"traceparent": parent})))
    assert traced is not None and traced.headers is not None
    if span_made:
        assert traced.span is not None and traced.headers["traceparent"] != parent
    else:
        assert traced.span is None and traced.headers == {"traceparent": parent}
    assert len(exporter.get_finished_spans()) == int(span_made)
    made.shutdown()


def test_baggage_alone_starts_a_trace_that_keeps_it(
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    made, exporter = provider
    t = tracing.Tracing("child", 300.0, made.get_tracer("t"), unsampled_parents_dropped=True)
    traced = _message(t, _row(json.dumps({"baggage": "user=42"})))
    assert traced is not None and traced.headers is not None
    assert traced.headers["baggage"] == "user=42"
    assert _spans(exporter)["publish q"].parent is None


def test_a_fault_in_tracing_costs_the_job_its_context_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        sampler = None

        def start_span(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("exporter on fire")

    t = tracing.Tracing("child", 300.0, Broken())  # type: ignore[arg-type]
    assert t.message(_row(_carrier()), None, NOW.timestamp()) is None
    assert t.message(_row(_carrier()), None, NOW.timestamp()) is None
    assert [r.message.split(":")[0] for r in caplog.records] == [
        "tracing failed for a job (task id 00000000-0000-0000-0000-000000000001)"]


def test_the_fast_reading_of_a_lone_traceparent_agrees_with_json() -> None:
    rng = random.Random(7)
    alphabet = "0123456789abcdefABx-"
    for _ in range(2000):
        parent = "".join(rng.choice(alphabet) for _ in range(rng.choice([54, 55, 55, 56])))
        if rng.random() < 0.5:
            parent = (f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-"
                      f"0{rng.randrange(4)}")
        text = '{"traceparent": "' + parent + '"}'  # as jsonb prints it
        slow = tracing.carrier(json.dumps({"traceparent": parent}, separators=(",", ":")))
        assert tracing.carrier(text) == slow, parent


def test_a_job_that_cannot_be_built_ends_its_span_as_an_error(
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    made, exporter = provider
    t = tracing.Tracing("child", 300.0, made.get_tracer("t"))
    traced = t.message(_row(_carrier()), None, NOW.timestamp())
    assert traced is not None
    t.failed(traced, ValueError("too large"))
    publish = _spans(exporter)["publish q"]
    assert publish.status.status_code == trace.StatusCode.ERROR


def test_capture_stores_the_current_context_and_nothing_outside_one(
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    made, _ = provider
    assert trace_context.capture() is None  # no span, no baggage
    with made.get_tracer("t").start_as_current_span("request") as span:
        token = context.attach(baggage.set_baggage("user", "42"))
        try:
            captured = json.loads(trace_context.capture() or "null")
        finally:
            context.detach(token)
    assert captured == {
        "traceparent": f"00-{span.get_span_context().trace_id:032x}-"
                       f"{span.get_span_context().span_id:016x}-"
                       f"{int(span.get_span_context().trace_flags):02x}",
        "baggage": "user=42",
    }


def test_a_run_without_the_otel_variables_has_no_span(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in trace_context.SDK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with trace_context.run_span("backfill", "b1", "token") as carrier:
        assert carrier is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert trace_context.configured_tracer() is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert trace_context.configured_tracer() is None


def test_an_exporter_nobody_provides_is_refused_in_one_line() -> None:
    code = "import drain.trace_context as t; t.configured_tracer()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, env={"OTEL_TRACES_EXPORTER": "zipkin", "PATH": ""})
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "drain.errors.ConfigError: OTEL_TRACES_EXPORTER names 'zipkin', which no installed "
        "package provides (installed: console, otlp_proto_http); pip install "
        "'drain-outbox[otel]' brings the OTLP exporter")


def test_a_failing_propagator_leaves_the_job_without_a_context(
    provider: tuple[TracerProvider, InMemorySpanExporter], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry import propagate

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a custom propagator fails")

    monkeypatch.setattr(propagate, "inject", broken)
    made, _ = provider
    with made.get_tracer("t").start_as_current_span("request"):
        assert trace_context.capture() is None


def test_staging_without_opentelemetry_imports_none_of_it() -> None:
    code = ("import sys, drain, drain.staging, drain.trace_context as t\n"
            "assert t.capture() is None\n"
            "assert not [m for m in sys.modules if m.startswith('opentelemetry')], "
            "sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
