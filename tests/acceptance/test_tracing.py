"""One trace from the code that staged a job to the worker that ran it.

Real parts only: this test process is the application (its own TracerProvider,
a span around a real psycopg transaction that stages), ``drain run`` and a
``celery worker`` (tests/tracing_app.py, with opentelemetry-instrumentation-celery)
are subprocesses, and every process exports its spans over OTLP/HTTP to a
receiver on 127.0.0.1 (tests/otlp.py). The drain runs as its least-privileged
role, configured by the standard OTEL_* variables only.
"""

from __future__ import annotations

import re
import signal
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Tracer

import drain
from tests import roles, support, tracing_app
from tests.otlp import Receiver, Span


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as started:
        yield started


@pytest.fixture
def tracer(receiver: Receiver) -> Iterator[Tracer]:
    """The application's tracer: spans exported as they end."""
    provider = TracerProvider(resource=Resource.create({"service.name": "app"}))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")))
    yield provider.get_tracer("app")
    provider.shutdown()


def _env(db_url: str, queue: str, receiver: Receiver, service: str,
         role: str = roles.RUNNER) -> dict[str, str]:
    """The process's environment: no OTEL_* inherited from ours, only the receiver's."""
    env = {k: v for k, v in support.drain_env(db_url, role, DRAIN_TEST_QUEUE=queue,
                                              TRACING_APP_DATABASE_URL=db_url).items()
           if not k.startswith("OTEL_")}
    return {**env, **receiver.env(service)}


def _start(spawn: Any, db_url: str, queue: str, receiver: Receiver, *drain_args: str) -> Any:
    """A traced worker on ``queue`` (ready), then ``drain run --app tests.tracing_app``."""
    worker = spawn([*support.celery_argv(queue)[:3], "-A", "tests.tracing_app", "worker",
                    "-Q", queue, "-P", "threads", "-c", "1", "--without-gossip",
                    "--without-mingle", "-l", "info", "-n", f"{queue}@%h"],
                   _env(db_url, queue, receiver, "worker", roles.ADMIN), "worker")
    worker.wait_for_output("ready.", timeout=60)
    return spawn(support.drain_argv("run", "--app", "tests.tracing_app", "--poll-interval",
                                    "0.2", *drain_args),
                 _env(db_url, queue, receiver, "drain"), "drain")


def _publish(receiver: Receiver, task_id: str, count: int = 1) -> list[Span]:
    def found(spans: list[Span]) -> list[Span] | None:
        ours = [s for s in spans if s.name.startswith("publish ")
                and s.attributes.get("messaging.message.id") == task_id]
        return ours if len(ours) >= count else None
    return receiver.wait_for(found, what=f"{count} publish span(s) of {task_id}")


def _run(receiver: Receiver, parent: Span) -> Span:
    """The worker's run span under ``parent`` (a publish span or a producer span)."""
    def found(spans: list[Span]) -> Span | None:
        return next((s for s in spans if s.name.startswith("run/")
                     and s.parent_span_id == parent.span_id), None)
    return receiver.wait_for(found, what=f"the run span under {parent.name}")


def _runs(db_url: str, count: int) -> list[dict[str, Any]]:
    def ran() -> list[dict[str, Any]] | None:
        found = tracing_app.runs(db_url)
        return found if len(found) >= count else None
    result: list[dict[str, Any]] = support.wait_for(ran, 60, f"{count} task runs")
    return result


def test_one_trace_from_the_staging_request_to_the_worker(
    db_url: str, queue: str, spawn: Any, receiver: Receiver, tracer: Tracer,
) -> None:
    metrics_port = support.free_port()
    _start(spawn, db_url, queue, receiver, "--metrics-port", str(metrics_port))
    with (tracer.start_as_current_span("POST /annotations") as request,
          psycopg.connect(db_url) as conn):
        plain = drain.stage(conn, "tracing.record", ["plain"])
        delayed = drain.stage(conn, "tracing.record", ["delayed"], countdown=2)
        steps = tracing_app.step.s(1) | tracing_app.step.s()
        first = drain.stage(conn, steps)
    with psycopg.connect(db_url) as conn:
        orphan = drain.stage(conn, "tracing.record", ["orphan"])
    trace_id = f"{request.get_span_context().trace_id:032x}"
    request_id = f"{request.get_span_context().span_id:016x}"

    runs = {r["given"]: r for r in _runs(db_url, 5) if isinstance(r["given"], str)}
    for task_id, label in ((plain, "plain"), (delayed, "delayed")):
        (publish,) = _publish(receiver, str(task_id))
        assert (publish.trace_id, publish.parent_span_id) == (trace_id, request_id)
        assert (publish.kind, publish.service) == ("PRODUCER", "drain")
        assert publish.name == f"publish {queue}"
        assert publish.attributes["messaging.destination.name"] == "amq.default"
        assert publish.attributes["messaging.rabbitmq.destination.routing_key"] == queue
        assert publish.attributes["messaging.message.body.size"] > 0
        run = _run(receiver, publish)
        assert (run.trace_id, run.kind, run.service) == (trace_id, "CONSUMER", "worker")
        assert run.name == "run/tracing.record"
        # The task's body runs inside that span.
        assert (runs[label]["trace_id"], runs[label]["span_id"]) == (trace_id, run.span_id)
    (delayed_publish,) = _publish(receiver, str(delayed))
    assert delayed_publish.attributes["drain.job.waited_seconds"] < 60

    # The chain: its first step through the drain, the next one published by the
    # worker inside the first step's run span: all one trace.
    (step_publish,) = _publish(receiver, str(first))
    assert step_publish.parent_span_id == request_id
    step_run = _run(receiver, step_publish)
    next_publish = receiver.wait_for(lambda spans: next(
        (s for s in spans if s.parent_span_id == step_run.span_id
         and s.name == "apply_async/tracing.step"), None), what="the chain's next publish")
    next_run = _run(receiver, next_publish)
    assert {step_run.trace_id, next_publish.trace_id, next_run.trace_id} == {trace_id}

    # Staged with no context: a fresh trace starts at the drain.
    (orphan_publish,) = _publish(receiver, str(orphan))
    assert orphan_publish.parent_span_id is None and orphan_publish.trace_id != trace_id
    assert _run(receiver, orphan_publish).trace_id == orphan_publish.trace_id

    # The batch span links the messages it published.
    linked = {link.span_id for s in receiver.by_name("drain batch") for link in s.links}
    assert {step_publish.span_id, orphan_publish.span_id} <= linked

    # The wait histogram's exemplars point at the jobs' traces (OpenMetrics only).
    request_ = urllib.request.Request(f"http://127.0.0.1:{metrics_port}/metrics",
                                      headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(request_, timeout=5) as answer:
        exposition = answer.read().decode()
    exemplars = set(re.findall(r'drain_job_wait_seconds_bucket\{[^}]*\} \S+ # '
                               r'\{trace_id="([0-9a-f]{32})"\}', exposition))
    assert exemplars and exemplars <= {trace_id, orphan_publish.trace_id} | {
        s.trace_id for s in receiver.by_name("drain batch")}


def test_long_waits_and_requeued_dead_jobs_start_a_linked_trace(
    db_url: str, queue: str, spawn: Any, receiver: Receiver, tracer: Tracer,
) -> None:
    with (tracer.start_as_current_span("POST /imports") as request,
          psycopg.connect(db_url) as conn):
        expiring = drain.stage(conn, "tracing.record", ["requeued"], expires=0.5)
    staging = request.get_span_context()
    # Expired before any drain ran: a first drain moves it to dead_jobs.
    support.wait_for(lambda: _expired(db_url, str(expiring)), 30, "the job to expire")
    run = support.run_cli(db_url, "run", "--exit-when-empty",
                          env=_env(db_url, queue, receiver, "drain"))
    assert run.returncode == 0, run.stderr
    requeue = support.run_cli(db_url, "dead", "requeue", "--reason", "expired",
                              "--expires-in", "1h", "--yes",
                              env=_env(db_url, queue, receiver, "ops"))
    assert requeue.returncode == 0, requeue.stderr

    _start(spawn, db_url, queue, receiver, "--trace-new-after", "1")
    with (tracer.start_as_current_span("POST /reminders") as reminder,
          psycopg.connect(db_url) as conn):
        late = drain.stage(conn, "tracing.record", ["late"], countdown=2)
    _runs(db_url, 2)
    for task_id, span, reason in ((expiring, staging, "requeued"),
                                  (late, reminder.get_span_context(), "waited")):
        (publish,) = _publish(receiver, str(task_id))
        assert publish.parent_span_id is None
        assert publish.trace_id != f"{span.trace_id:032x}"
        (link,) = publish.links
        assert (link.trace_id, link.span_id) == (f"{span.trace_id:032x}", f"{span.span_id:016x}")
        assert link.attributes == {"drain.link.reason": reason}
        assert _run(receiver, publish).trace_id == publish.trace_id


def _expired(db_url: str, task_id: str) -> bool:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT expires_at < now() FROM staged_jobs WHERE task_id = %s",
                           (task_id,)).fetchone()
    return row == (True,)


def test_a_job_republished_after_kill_9_has_both_copies_in_its_trace(
    db_url: str, queue: str, spawn: Any, receiver: Receiver, tracer: Tracer,
) -> None:
    """The drain is killed between the broker's confirm and the row's delete (held
    up by a trigger), and a second drain publishes the row again: both copies, and
    both runs, are in the staging trace."""
    with psycopg.connect(db_url) as conn:
        conn.execute("""
            CREATE FUNCTION hold_delete() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF OLD.args = '["crash"]' THEN PERFORM pg_sleep(300); END IF;
                RETURN OLD;
            END $$;
            CREATE TRIGGER hold_delete BEFORE DELETE ON staged_jobs
                FOR EACH ROW EXECUTE FUNCTION hold_delete();""")
    first_drain = _start(spawn, db_url, queue, receiver)
    with (tracer.start_as_current_span("POST /crash") as request,
          psycopg.connect(db_url) as conn):
        task_id = drain.stage(conn, "tracing.record", ["crash"])
    _publish(receiver, str(task_id))  # published, confirmed: the delete is held up
    first_drain.kill(signal.SIGKILL)
    with psycopg.connect(db_url, autocommit=True) as conn:
        # The killed drain's backend sleeps on in the trigger, holding the row (and
        # a lock that DROP TRIGGER would wait for).
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                     "WHERE wait_event = 'PgSleep' AND pid <> pg_backend_pid()")
        conn.execute("DROP TRIGGER hold_delete ON staged_jobs")
    spawn(support.drain_argv("run", "--app", "tests.tracing_app", "--poll-interval", "0.2"),
          _env(db_url, queue, receiver, "drain"), "drain")
    copies = _publish(receiver, str(task_id), count=2)
    trace_id = f"{request.get_span_context().trace_id:032x}"
    request_id = f"{request.get_span_context().span_id:016x}"
    assert {(c.trace_id, c.parent_span_id) for c in copies} == {(trace_id, request_id)}
    assert len({c.span_id for c in copies}) == 2
    for copy in copies:
        assert _run(receiver, copy).trace_id == trace_id
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the row's delete")
