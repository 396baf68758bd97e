"""bench_throughput's OpenTelemetry rounds: what carrying and tracing the jobs' contexts
costs, quoted against the same run's plain drain (no context, no SDK).

* ``off``: every row staged with a context (a ``traceparent`` per row, as staging
  inside a request span writes it), the drain with tracing off
  (``--trace-context none``, no SDK): what the feature costs when it is not
  used. Goal >= 0.99 x plain.
* ``headers``: the same rows, the drain without the SDK forwarding each job's
  headers (``child``): the worker's span joins the staging trace, the drain
  records nothing. Reported.
* ``1%``: the same rows, 1 in 100 staged by a sampled request (as an application
  sampling 1 % writes them), the drain with the SDK, a parent-based 1 % sampler
  and the OTLP/HTTP exporter: a producer span per message (recorded for the
  sampled ones), a batch span. Goal >= 0.95 x plain.
* ``100%``: every row sampled, every span recorded and exported. Reported.

The spans go to an OTLP/HTTP sink in a process of its own (a collector stands
beside a drain in production); it counts the spans it received, so that the
rounds say how many the SDK's batch processor dropped (its queue holds 2,048 by
default). A round's time ends when the last row is deleted and the drain's
spans are flushed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from harness import BROKER_URL

from drain.daemon.runner import Drain
from drain.daemon.tracing import Tracing
from drain.settings.config import Settings

MODES = {
    "off": "drain run, every job with a context, tracing off (--trace-context none)",
    "headers": "drain run, every job with a context, no SDK (headers forwarded)",
    "1%": "drain run, every job with a context, SDK at 1 % (parent-based)",
    "100%": "drain run, every job with a context, SDK at 100 %",
}
GOALS = {"off": 0.99, "1%": 0.95}

_SINK = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest)
    spans = 0
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            global spans
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/v1/traces":
                request = ExportTraceServiceRequest.FromString(body)
                spans += sum(len(s.spans) for r in request.resource_spans
                             for s in r.scope_spans)
            self.send_response(200); self.send_header("Content-Length", "0")
            self.end_headers()
        def do_GET(self):
            data = str(spans).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(data)))
            self.end_headers(); self.wfile.write(data)
        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
""")


@contextmanager
def sink() -> Iterator[str]:
    """An OTLP/HTTP endpoint in a process of its own; GET / says how many spans came."""
    proc = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait()


def spans_received(endpoint: str) -> int:
    with urllib.request.urlopen(endpoint, timeout=10) as answer:
        return int(answer.read())


def stage_traced(url: str, n: int, queue: str, mode: str) -> None:
    """``n`` jobs as harness.stage stages them, each with its own request's context,
    sampled as ``mode`` samples (1 in 100 for 1 %, all otherwise); then VACUUM."""
    sampled_every = 100 if mode == "1%" else 1
    with psycopg.connect(url) as conn, conn.cursor() as cur, cur.copy(
            "COPY staged_jobs (task_name, args, kwargs, queue, trace) FROM STDIN") as copy:
        for i in range(n):
            flags = "01" if i % sampled_every == 0 else "00"
            copy.write_row((
                "bench.index_annotation", f"[{i}]", f'{{"user": "user{i % 97}"}}', queue,
                f'{{"traceparent": "00-{i + 1:032x}-{i + 1:016x}-{flags}"}}'))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) staged_jobs")


def traced_round(url: str, n: int, mode: str, *, size: tuple[int, int],
                 endpoint: str) -> tuple[float, dict[str, Any]]:
    """One drain round in ``mode`` over the ``n`` rows :func:`stage_traced` staged;
    its seconds (until the rows are gone and the spans flushed) and what the SDK did."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    drain = Drain(Settings(database_url=url, broker_url=BROKER_URL, batch_size=size[0],
                           pipeline=size[1]), exit_when_empty=True)
    provider = None
    if mode == "off":
        drain.pipeline.tracing = Tracing("none", 300.0)
    elif mode != "headers":
        ratio = 0.01 if mode == "1%" else 1.0
        provider = TracerProvider(resource=Resource.create({"service.name": "drain"}),
                                  sampler=ParentBased(TraceIdRatioBased(ratio)))
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
        drain.pipeline.tracing = Tracing("child", 300.0, provider.get_tracer("drain"))
    before = spans_received(endpoint)
    t0 = time.perf_counter()
    drain.run()
    if provider is not None:
        provider.force_flush()
    elapsed = time.perf_counter() - t0
    if provider is not None:
        provider.shutdown()
    assert drain.published == n, (drain.published, n)
    return elapsed, {"spans_exported": spans_received(endpoint) - before}


def rows(n: int, rates: dict[str, float], plain: float, modes: list[str]) -> list[dict[str, Any]]:
    """The summary's rows: off and 1 % against their goals, 100 % reported."""
    found = []
    for mode in modes:
        rate = rates[MODES[mode]]
        goal = GOALS.get(mode)
        found.append({
            "target": f"throughput, tracing {mode}",
            "goal": f">= {goal} x the plain drain" if goal else "reported",
            "measured": f"{rate / plain:.2f} x ({rate:,.0f} vs {plain:,.0f} msg/s)"
                        + ("" if n >= 200_000 else f" (at {n:,} jobs)"),
            "met": (rate / plain >= goal) if goal and n >= 200_000 else None,
        })
    return found


def parse_modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(MODES)}, got {text!r}")
    return modes
