"""A real OTLP/HTTP trace receiver for tests, on 127.0.0.1.

The tracing tests check what the drain, an application and a real Celery
worker export, over the wire an OpenTelemetry collector would see: protobuf
``ExportTraceServiceRequest`` bodies POSTed to ``/v1/traces``, gzip or deflate
compressed or not. :class:`Receiver` decodes them into :class:`Span` values a
test can assert on, and :meth:`Receiver.wait_for` waits for the spans a test
expects (exports arrive in batches, from other processes, at their own pace).
``/v1/metrics`` and ``/v1/logs`` are answered 200 and ignored, so a process
that exports those too logs no errors.

    with Receiver() as receiver:
        worker = spawn(argv, {**env, **receiver.env("worker")}, "worker")
        ...
        run = receiver.wait_for(lambda spans: next(
            (s for s in spans if s.name == "run/tracing.record"), None))
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, TypeVar

# No stubs for protobuf here (types-protobuf is not a dependency): DecodeError is Any.
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus

from tests import support

T = TypeVar("T")

PROTOBUF = "application/x-protobuf"
#: The paths answered 200 without being looked at: a process exporting metrics or
#: logs beside its traces gets no error for them.
IGNORED_PATHS = frozenset({"/v1/metrics", "/v1/logs"})


@dataclass(frozen=True)
class Link:
    """A span's link to another span (possibly of another trace)."""

    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    """One exported span, ids in lowercase hex as in a ``traceparent`` header.

    ``kind`` is the OTLP kind without its prefix ("PRODUCER", "CONSUMER",
    "INTERNAL", "SERVER", "CLIENT"); ``service`` the resource's
    ``service.name``; attribute values are str, int, float, bool, tuples of
    them (arrays), dicts (key-value lists), bytes or None. ``scope`` (the
    instrumentation scope's name) and ``status`` ("UNSET", "OK", "ERROR") come
    last, for the tests that look at who made a span and whether it failed."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    service: str
    attributes: dict[str, Any]
    links: tuple[Link, ...]
    start_ns: int
    end_ns: int
    scope: str = ""
    status: str = "UNSET"


def _value(value: AnyValue) -> Any:
    """An OTLP attribute value as the Python value the SDK was given."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, which)


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _kind(kind: int) -> str:
    return str(ProtoSpan.SpanKind.Name(kind)).removeprefix("SPAN_KIND_")


def _status(code: int) -> str:
    return str(ProtoStatus.StatusCode.Name(code)).removeprefix("STATUS_CODE_")


def decode(request: ExportTraceServiceRequest) -> list[Span]:
    """The spans of one export request, in the order they were sent."""
    spans: list[Span] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(Span(
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex() or None,
                    name=span.name,
                    kind=_kind(span.kind),
                    service=service,
                    attributes=_attributes(span.attributes),
                    links=tuple(Link(link.trace_id.hex(), link.span_id.hex(),
                                     _attributes(link.attributes)) for link in span.links),
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    scope=scope_spans.scope.name,
                    status=_status(span.status.code),
                ))
    return spans


def _decompress(body: bytes, encoding: str) -> bytes:
    """The body as sent before OTEL_EXPORTER_OTLP_COMPRESSION (gzip, deflate) or none."""
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    if encoding in ("", "identity"):
        return body
    raise ValueError(f"unknown Content-Encoding {encoding!r}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, receiver: Receiver) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.receiver = receiver


class _Handler(BaseHTTPRequestHandler):
    """Answers the OTLP/HTTP exporters' POSTs; anything refused is noted in
    :attr:`Receiver.errors` (and shows in a timed-out wait's message)."""

    def do_POST(self) -> None:
        assert isinstance(self.server, _Server)
        receiver = self.server.receiver
        path = self.path.split("?", 1)[0]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path in IGNORED_PATHS:
            self._answer(200, b"")
            return
        if path != "/v1/traces":
            receiver.note_error(f"POST {path}: not an OTLP path")
            self._answer(404, b"")
            return
        content_type = self.headers.get("Content-Type", "")
        if not content_type.startswith(PROTOBUF):
            receiver.note_error(f"POST {path}: Content-Type {content_type!r}, not protobuf")
            self._answer(415, b"")
            return
        try:
            raw = _decompress(body, self.headers.get("Content-Encoding", "").strip().lower())
            request = ExportTraceServiceRequest.FromString(raw)
        except (ValueError, OSError, zlib.error, DecodeError) as exc:
            receiver.note_error(f"POST {path}: undecodable body: {exc}")
            self._answer(400, b"")
            return
        receiver.add(decode(request))
        self._answer(200, ExportTraceServiceResponse().SerializeToString())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", PROTOBUF)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a request per export batch would fill the test's output."""


class Receiver:
    """An OTLP/HTTP trace receiver on a free port of 127.0.0.1, for a ``with`` block.

    Every span exported to it is kept (:attr:`spans`), in the order the
    exports arrived; a condition is notified on each export, which
    :meth:`wait_for` waits on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._spans: list[Span] = []
        self._errors: list[str] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Receiver:
        # free_port()'s port was free a moment ago; should something take it
        # before we bind, another one will do.
        for attempt in range(5):
            try:
                self._server = _Server(support.free_port(), self)
                break
            except OSError:
                if attempt == 4:
                    raise
        assert self._server is not None
        # serve_forever notices shutdown() between polls: 50 ms, not its 0.5 s, per test.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    @property
    def port(self) -> int:
        assert self._server is not None, "the receiver is not started (use it in a with block)"
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """The base URL (OTEL_EXPORTER_OTLP_ENDPOINT); the exporters add /v1/traces."""
        return f"http://127.0.0.1:{self.port}"

    def env(self, service_name: str) -> dict[str, str]:
        """The OTEL_* environment of a process that exports its traces here as
        ``service_name``: merge it into the process's environment. Batches go
        out every 100 ms (instead of 5 s); metrics and logs are not exported.
        A signal-specific variable inherited from the caller's environment
        (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT...) still wins over these."""
        return {
            "OTEL_SERVICE_NAME": service_name,
            # The entry point opentelemetry-exporter-otlp-proto-http registers
            # (group opentelemetry_traces_exporter).
            "OTEL_TRACES_EXPORTER": "otlp_proto_http",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        }

    def add(self, spans: list[Span]) -> None:
        """Keep one export's spans and wake the waiters."""
        with self._cond:
            self._spans.extend(spans)
            self._cond.notify_all()

    def note_error(self, error: str) -> None:
        """Keep a refused request's reason and wake the waiters (nothing more will come of it)."""
        with self._cond:
            self._errors.append(error)
            self._cond.notify_all()

    @property
    def spans(self) -> list[Span]:
        """Every span received so far (a copy), in the order they arrived."""
        with self._cond:
            return list(self._spans)

    @property
    def errors(self) -> list[str]:
        """The requests refused so far (wrong path, content type or body), why."""
        with self._cond:
            return list(self._errors)

    def by_name(self, name_or_prefix: str) -> list[Span]:
        """The spans received so far whose name is or starts with ``name_or_prefix``."""
        return [s for s in self.spans if s.name.startswith(name_or_prefix)]

    def trace(self, trace_id: str) -> list[Span]:
        """The spans received so far of trace ``trace_id``, in the order they started."""
        return sorted((s for s in self.spans if s.trace_id == trace_id),
                      key=lambda s: s.start_ns)

    def wait_for(self, predicate: Callable[[list[Span]], T | None],
                 timeout: float = 60.0, what: str = "the spans expected") -> T:
        """Wait until ``predicate(spans)`` (given a copy of every span so far) is
        truthy, and return that; re-evaluated on each export. After ``timeout``
        seconds, AssertionError with the spans seen (and any refused request).
        ``predicate`` runs under the receiver's lock: keep it quick."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = predicate(list(self._spans))
                if found:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(self._summary(f"timed out after {timeout}s "
                                                       f"waiting for {what}"))
                self._cond.wait(remaining)

    def _summary(self, headline: str, limit: int = 60) -> str:
        """``headline``, then the spans seen so far (name, kind, service, trace id prefix)."""
        lines = [f"{headline}; {len(self._spans)} span(s) received:"]
        lines += [f"  {s.name} [{s.kind}] service={s.service} trace={s.trace_id[:8]} "
                  f"span={s.span_id[:8]} parent={(s.parent_span_id or '-')[:8]}"
                  for s in self._spans[:limit]]
        if len(self._spans) > limit:
            lines.append(f"  ... and {len(self._spans) - limit} more")
        lines += [f"  refused: {error}" for error in self._errors]
        return "\n".join(lines)
