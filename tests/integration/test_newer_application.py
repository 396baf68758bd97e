"""An application newer than its database's schema (issue 38): this package's
``stage()`` and ``stage_many()`` (through psycopg, SQLAlchemy and Django) on a
database that an older ``drain migrate`` made, before the ``trace`` column,
inside and outside an OpenTelemetry span.

Before, a job staged inside a span failed its INSERT (no column ``trace``) and
with it the caller's transaction: 3 of 3 tries rolled back the application's
own row. Now the job is staged without its trace context, the log says so once,
and the application's own row commits with it; after ``drain migrate`` the next
jobs carry their context again. A job whose ``embed`` (a signature's callbacks)
cannot be written is refused before any SQL, and the transaction goes on.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy
from opentelemetry.sdk.trace import TracerProvider

import drain
from drain import staging
from drain.errors import StagingError
from drain.postgres.migration import migrate
from tests import support

StageOne = Callable[[Any, str], None]


@pytest.fixture
def before_trace(db_url: str) -> str:
    """A database as an older ``drain migrate`` left it: without the trace columns."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE staged_jobs DROP COLUMN trace")
        conn.execute("ALTER TABLE dead_jobs DROP COLUMN trace")
    staging._said.clear()  # "said once per process": once per test here
    return db_url


@pytest.fixture
def tracer() -> Iterator[Any]:
    provider = TracerProvider()
    yield provider.get_tracer("app")
    provider.shutdown()


def _stage(conn: Any, task: str) -> None:
    drain.stage(conn, task, [1])


def _stage_many(conn: Any, task: str) -> None:
    drain.stage_many(conn, [drain.Job(task, [1]), drain.Job(task, [2])])


def _app_rows(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS app_orders (id int)")
    conn.execute("INSERT INTO app_orders VALUES (1)")


def _staged(db_url: str) -> list[tuple[str, Any]]:
    with psycopg.connect(db_url) as conn:
        return [(str(r[0]), r[1]) for r in conn.execute(
            "SELECT task_name, to_jsonb(s) -> 'trace' FROM staged_jobs s ORDER BY id")]


@pytest.mark.parametrize("how", [_stage, _stage_many], ids=["stage", "stage_many"])
def test_a_job_staged_in_a_span_on_a_schema_without_trace_commits_without_it(
        before_trace: str, tracer: Any, how: StageOne, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "drain.staging"):
        for _ in range(2):
            with psycopg.connect(before_trace) as conn, tracer.start_as_current_span("request"):
                _app_rows(conn)
                how(conn, "t.traced")
    staged = _staged(before_trace)
    assert staged and all(task == "t.traced" and trace is None for task, trace in staged)
    with psycopg.connect(before_trace) as conn:
        assert conn.execute("SELECT count(*) FROM app_orders").fetchone() == (2,)
    said = [r for r in caplog.records if "no trace column" in r.getMessage()]
    assert len(said) == 1, caplog.text  # once, not per job
    assert "drain migrate" in said[0].getMessage()


def test_a_job_staged_outside_a_span_asks_the_database_nothing(before_trace: str) -> None:
    with psycopg.connect(before_trace) as conn:
        drain.stage(conn, "t.plain", [1])
        assert conn not in staging._seen
    assert _staged(before_trace) == [("t.plain", None)]


def test_through_sqlalchemy_too(before_trace: str, tracer: Any) -> None:
    engine = sqlalchemy.create_engine(
        before_trace.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn, tracer.start_as_current_span("request"):
            drain.stage(conn, "t.orm", [1])
    finally:
        engine.dispose()
    assert _staged(before_trace) == [("t.orm", None)]


def test_through_django_too(django_db: str, tracer: Any) -> None:
    """Django's connection, in an atomic block with a row of the application's own;
    the session's Django database gets its columns back afterwards."""
    from django.db import connection, transaction

    with psycopg.connect(django_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE staged_jobs DROP COLUMN trace")
        conn.execute("ALTER TABLE dead_jobs DROP COLUMN trace")
        conn.execute("DELETE FROM staged_jobs")
    staging._said.clear()
    try:
        with transaction.atomic(), tracer.start_as_current_span("request"):
            with connection.cursor() as cursor:
                cursor.execute("CREATE TABLE IF NOT EXISTS app_orders (id int)")
                cursor.execute("INSERT INTO app_orders VALUES (1)")
            drain.stage(connection, "t.django", [1])
        assert _staged(django_db) == [("t.django", None)]
        with psycopg.connect(django_db) as conn:
            assert conn.execute("SELECT count(*) FROM app_orders").fetchone() == (1,)
    finally:
        connection.close()
        with psycopg.connect(django_db) as conn:
            conn.execute("DROP TABLE IF EXISTS app_orders")
            conn.execute("DELETE FROM staged_jobs")
            conn.commit()
            migrate(conn)


def test_after_drain_migrate_the_context_is_written_again(
        before_trace: str, tracer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "_RECHECK", 0.0)  # a pooled connection asks again at once
    with psycopg.connect(before_trace, autocommit=True) as conn:
        with tracer.start_as_current_span("request"):
            drain.stage(conn, "t.before", [1])
        with psycopg.connect(before_trace) as admin:
            migrate(admin)
        with tracer.start_as_current_span("request") as span:
            drain.stage(conn, "t.after", [1])
    staged = dict(_staged(before_trace))
    assert staged["t.before"] is None
    assert json.loads(json.dumps(staged["t.after"]))["traceparent"].split("-")[1] == (
        f"{span.get_span_context().trace_id:032x}")


def test_a_chain_needs_the_embed_column_and_is_refused_before_any_sql(db_url: str) -> None:
    support.as_an_older_schema(db_url)  # before embed (and trace's neighbours)
    staging._said.clear()
    signature: dict[str, Any] = {"task": "t.first", "args": [1], "kwargs": {}, "options": {
        "link": [{"task": "t.next", "args": [], "kwargs": {}, "options": {},
                  "subtask_type": None, "immutable": False}]},
        "subtask_type": None, "immutable": False}
    with psycopg.connect(db_url) as conn:
        _app_rows(conn)
        with pytest.raises(StagingError, match=r"no embed column.*drain migrate"):
            drain.stage(conn, signature)
        drain.stage(conn, "t.plain", [1])  # the transaction goes on
    assert [task for task, _ in _staged(db_url)] == ["t.plain"]
