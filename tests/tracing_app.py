"""The Celery app of the tracing tests: a real worker that exports its spans.

``celery -A tests.tracing_app worker`` sets up tracing as the
opentelemetry-instrumentation-celery docs tell users to, and only when
``OTEL_TRACES_EXPORTER`` is set (tests/otlp.py's ``Receiver.env``), so that
importing the module anywhere else (a test, ``drain run --app``) does nothing:

* a TracerProvider with the resource of the environment (``OTEL_SERVICE_NAME``),
  a BatchSpanProcessor and an OTLPSpanExporter (``OTEL_EXPORTER_OTLP_ENDPOINT``),
  then ``CeleryInstrumentor().instrument()``, once per process, in the process
  that runs the tasks: on ``worker_process_init`` in each prefork child (after
  the fork, as those docs say: not relying on the SDK to restart a batch
  processor's thread in a child), on ``worker_init`` for the other pools
  (threads, solo), whose tasks run in the worker's own process;
* ``provider.shutdown()`` on ``worker_process_shutdown`` (a prefork child ends
  with ``os._exit``: no atexit hook runs) and on ``worker_shutdown``, so the
  last spans are sent before the process ends. A SIGKILLed worker (the
  ``spawn`` fixture's stop) sends none: wait for the spans before teardown.

Broker ``DRAIN_TEST_BROKER_URL``, no result backend, default queue
``DRAIN_TEST_QUEUE``. The tasks ``tracing.record(label)`` and
``tracing.step(value)`` (returns ``value + 1``, for chains) record each run in
``tracing_runs`` of the database ``TRACING_APP_DATABASE_URL`` names, with the
trace and span ids current in the task's body (:func:`runs` reads them back).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import psycopg
from celery import Celery, Task, signals
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

BROKER_URL = os.environ.get("DRAIN_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")

app = Celery("tracing_app", broker=BROKER_URL)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    result_backend=None,
    task_ignore_result=True,
    task_default_queue=os.environ.get("DRAIN_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

# -- tracing -----------------------------------------------------------------------

class _Tracing:
    """The provider this process set up, and the process it belongs to: a forked
    child inherits these, not the batch processor's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.provider: TracerProvider | None = None
        self.pid: int | None = None


_tracing = _Tracing()


def tracing_wanted() -> bool:
    """Whether the environment asks for traces: OTEL_TRACES_EXPORTER set and not
    "none", OTEL_SDK_DISABLED not "true" (as the drain reads them)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() not in ("", "none")


def configure_tracing() -> None:
    """Set up this process's TracerProvider and instrument Celery, once per process."""
    with _tracing.lock:
        if not tracing_wanted() or _tracing.pid == os.getpid():
            return
        provider = TracerProvider(resource=Resource.create())
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        CeleryInstrumentor().instrument()
        _tracing.provider, _tracing.pid = provider, os.getpid()


def shutdown_tracing() -> None:
    """Send the spans still batched and stop the exporter (this process's provider only)."""
    with _tracing.lock:
        provider = _tracing.provider if _tracing.pid == os.getpid() else None
        _tracing.provider = None
    if provider is not None:
        provider.shutdown()


def _prefork(worker: Any) -> bool:
    """Whether ``worker`` (worker_init's sender) runs its tasks in prefork children.
    Its ``pool_cls`` is still a name or a class there (the CLI gives a class)."""
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool as PreforkPool

    pool = get_implementation(getattr(worker, "pool_cls", "prefork"))
    return isinstance(pool, type) and issubclass(pool, PreforkPool)


@signals.worker_init.connect(weak=False)
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    # The main process runs the tasks of the threads and solo pools; for prefork,
    # the children set up their own (worker_process_init).
    if not _prefork(sender):
        configure_tracing()


@signals.worker_process_init.connect(weak=False)
def _on_worker_process_init(**_: Any) -> None:
    # Each prefork child; Celery 5.7's solo pool sends it too, in the main process
    # worker_init already set up (a no-op then).
    configure_tracing()


@signals.worker_process_shutdown.connect(weak=False)
def _on_worker_process_shutdown(**_: Any) -> None:
    shutdown_tracing()


@signals.worker_shutdown.connect(weak=False)
def _on_worker_shutdown(**_: Any) -> None:
    shutdown_tracing()


# -- tasks -------------------------------------------------------------------------

_DDL = """
CREATE TABLE IF NOT EXISTS tracing_runs (
    seq       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id   text NOT NULL,
    task_name text NOT NULL,
    given     jsonb NOT NULL,
    -- The span current in the task's body (the instrumentation's run span), hex.
    trace_id  text,
    span_id   text,
    parent_id text,
    root_id   text,
    pid       integer NOT NULL
)
"""


def _record(task: Task, given: Any) -> None:
    """A row in tracing_runs for this run (nothing without TRACING_APP_DATABASE_URL)."""
    url = os.environ.get("TRACING_APP_DATABASE_URL")
    if not url:
        return
    context = trace.get_current_span().get_span_context()
    trace_id = format(context.trace_id, "032x") if context.is_valid else None
    span_id = format(context.span_id, "016x") if context.is_valid else None
    with psycopg.connect(url) as conn:  # one transaction: DDL and row
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('tracing_app ddl'))")
        conn.execute(_DDL)
        conn.execute(
            "INSERT INTO tracing_runs (task_id, task_name, given, trace_id, span_id, "
            "parent_id, root_id, pid) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (task.request.id, task.name, json.dumps(given), trace_id, span_id,
             task.request.parent_id, task.request.root_id, os.getpid()))


def runs(db_url: str) -> list[dict[str, Any]]:
    """The rows of tracing_runs in the order the tasks ran (empty before the first)."""
    with psycopg.connect(db_url) as conn:
        exists = conn.execute("SELECT to_regclass('tracing_runs') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return []
        cur = conn.execute("SELECT task_id, task_name, given, trace_id, span_id, parent_id, "
                           "root_id, pid FROM tracing_runs ORDER BY seq")
        names = [column.name for column in cur.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


@app.task(name="tracing.record", bind=True, shared=False)
def record(self: Task, label: str) -> str:
    """Record that it ran, with ``label`` and the span current in its body."""
    _record(self, label)
    return label


@app.task(name="tracing.step", bind=True, shared=False)
def step(self: Task, value: int) -> int:
    """Record its run and return ``value + 1``: a chain's link."""
    _record(self, value)
    return value + 1
