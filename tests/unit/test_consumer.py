"""drain.consumer's logic, on a recording fake DB-API connection (no database).

* claim() refuses a task id that is not a UUID before running any SQL, sends
  one INSERT ... ON CONFLICT DO NOTHING with the canonical id, reports True
  only when a row came back, and never commits or rolls back.
* purge() validates its arguments before any SQL, deletes in batches of
  batch_size until a batch comes back short, commits after every batch, and
  refuses a driver that cannot say how many rows it deleted.
* effectively_once() presents the body's signature without ``conn`` (what
  Celery checks calls against), refuses bodies that cannot take
  (self, conn, ...), and refuses a task without an id before connecting.
"""

from __future__ import annotations

import datetime as dt
import inspect
import types
import uuid
from typing import Any

import pytest

from drain.consumer import ConsumerError, claim, effectively_once, purge
from drain.errors import DrainError

TASK_ID = uuid.UUID("0b1c2d3e-4f50-4617-8a9b-0c1d2e3f4a5b")


class RecordingCursor:
    """A DB-API cursor that records statements and answers from scripted results."""

    def __init__(self, conn: RecordingConnection) -> None:
        self.conn = conn
        self.rowcount = -1
        self._row: Any = None

    def execute(self, statement: str, params: Any = None) -> None:
        self.conn.log.append(("execute", statement, params))
        self._row, self.rowcount = self.conn.results.pop(0) if self.conn.results else (None, 0)

    def fetchone(self) -> Any:
        return self._row

    def close(self) -> None:
        pass


class RecordingConnection:
    def __init__(self, results: list[tuple[Any, int]] | None = None) -> None:
        self.log: list[tuple[str, ...] | tuple[str, str, Any]] = []
        self.results = list(results or [])

    def cursor(self) -> RecordingCursor:
        return RecordingCursor(self)

    def commit(self) -> None:
        self.log.append(("commit",))

    def rollback(self) -> None:
        self.log.append(("rollback",))

    def statements(self) -> list[tuple[str, Any]]:
        return [(entry[1], entry[2]) for entry in self.log if entry[0] == "execute"]


# -- claim -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_id", "fragment"),
    [
        ("not-a-uuid", "not a UUID"),
        ("", "not a UUID"),
        ("0b1c2d3e-4f50-4617-8a9b-0c1d2e3f4a5", "not a UUID"),
        (None, "called directly"),
        (12345, "uuid.UUID or a str"),
        (TASK_ID.bytes, "uuid.UUID or a str"),
    ],
)
def test_claim_refuses_bad_task_ids_before_any_sql(task_id: Any, fragment: str) -> None:
    conn = RecordingConnection()
    with pytest.raises(ConsumerError, match=fragment):
        claim(conn, task_id)
    assert conn.log == []
    assert issubclass(ConsumerError, DrainError)


@pytest.mark.parametrize(
    "task_id",
    [TASK_ID, str(TASK_ID), str(TASK_ID).upper(), "{" + str(TASK_ID) + "}", TASK_ID.hex],
)
def test_claim_sends_one_insert_with_the_canonical_id(task_id: uuid.UUID | str) -> None:
    conn = RecordingConnection([((str(TASK_ID),), 1)])
    assert claim(conn, task_id) is True
    [(statement, params)] = conn.statements()
    assert statement == (
        "INSERT INTO drain_processed (task_id) VALUES (CAST(%(task_id)s AS uuid)) "
        "ON CONFLICT (task_id) DO NOTHING RETURNING task_id"
    )
    assert params == {"task_id": str(TASK_ID)}
    assert ("commit",) not in conn.log
    assert ("rollback",) not in conn.log


def test_claim_is_false_when_no_row_came_back() -> None:
    conn = RecordingConnection([(None, 0)])
    assert claim(conn, TASK_ID) is False
    assert len(conn.statements()) == 1
    assert conn.log[-1][0] == "execute"  # nothing committed or rolled back after it


def test_claim_on_a_dbapi_cursor() -> None:
    conn = RecordingConnection([((str(TASK_ID),), 1)])
    cursor = conn.cursor()
    assert claim(cursor, TASK_ID) is True
    assert conn.statements()[0][1] == {"task_id": str(TASK_ID)}


def test_claim_refuses_objects_it_cannot_run_sql_on() -> None:
    with pytest.raises(ConsumerError, match="cannot run SQL"):
        claim(object(), TASK_ID)


# -- purge -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("older_than", "batch_size", "fragment"),
    [
        (dt.timedelta(0), 10, "positive"),
        (dt.timedelta(seconds=-1), 10, "positive"),
        (7, 10, "timedelta"),
        ("7d", 10, "timedelta"),
        (dt.timedelta(days=7), 0, "batch_size"),
        (dt.timedelta(days=7), -5, "batch_size"),
        (dt.timedelta(days=7), True, "batch_size"),
        (dt.timedelta(days=7), 2.5, "batch_size"),
    ],
)
def test_purge_validates_before_any_sql(older_than: Any, batch_size: Any, fragment: str) -> None:
    conn = RecordingConnection()
    with pytest.raises(ConsumerError, match=fragment):
        purge(conn, older_than, batch_size=batch_size)
    assert conn.log == []


def test_purge_deletes_in_batches_and_commits_each() -> None:
    conn = RecordingConnection([(None, 10), (None, 10), (None, 3)])
    assert purge(conn, dt.timedelta(days=7, hours=12), batch_size=10) == 23
    assert [entry[0] for entry in conn.log] == ["execute", "commit"] * 3
    for statement, params in conn.statements():
        assert statement.startswith("DELETE FROM drain_processed WHERE task_id IN (")
        assert "processed_at < now() - make_interval(secs => " in statement
        assert "ORDER BY processed_at LIMIT %(batch_size)s" in statement
        assert params == {"seconds": 7.5 * 86400, "batch_size": 10}


def test_purge_stops_after_an_empty_batch_on_an_exact_multiple() -> None:
    conn = RecordingConnection([(None, 10), (None, 10), (None, 0), (None, 99)])
    assert purge(conn, dt.timedelta(hours=1), batch_size=10) == 20
    assert len(conn.statements()) == 3


def test_purge_of_nothing_is_one_statement() -> None:
    conn = RecordingConnection([(None, 0)])
    assert purge(conn, dt.timedelta(days=1)) == 0
    assert conn.statements()[0][1]["batch_size"] == 10_000


def test_purge_refuses_an_unknown_rowcount() -> None:
    conn = RecordingConnection([(None, -1)])
    with pytest.raises(ConsumerError, match="rowcount"):
        purge(conn, dt.timedelta(days=1))


def test_purge_rolls_back_a_failed_batch() -> None:
    class Failing(RecordingConnection):
        def cursor(self) -> RecordingCursor:
            cursor = super().cursor()

            def execute(statement: str, params: Any = None) -> None:
                raise RuntimeError("boom")

            cursor.execute = execute  # type: ignore[method-assign]
            return cursor

    conn = Failing()
    with pytest.raises(RuntimeError, match="boom"):
        purge(conn, dt.timedelta(days=1))
    assert conn.log == [("rollback",)]


def test_purge_needs_a_connection_that_can_commit() -> None:
    conn = RecordingConnection()
    with pytest.raises(ConsumerError, match="commit"):
        purge(conn.cursor(), dt.timedelta(days=1))
    assert conn.log == []


# -- effectively_once ----------------------------------------------------------------


def _never_connect() -> Any:
    raise AssertionError("connect() must not be called")


def test_decorated_task_signature_drops_conn() -> None:
    def body(self: Any, conn: Any, annotation_id: int, *, force: bool = False) -> int:
        return annotation_id

    wrapped = effectively_once(_never_connect)(body)
    assert list(inspect.signature(wrapped).parameters) == ["self", "annotation_id", "force"]
    assert wrapped.__name__ == "body"
    assert wrapped.__wrapped__ is body  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "body",
    [
        lambda self: None,
        lambda self, *args: None,
        lambda self, *, conn: None,
    ],
)
def test_bodies_without_self_and_conn_are_refused(body: Any) -> None:
    with pytest.raises(ConsumerError, match=r"must take \(self, conn, \.\.\.\)"):
        effectively_once(_never_connect)(body)


def test_a_task_without_an_id_is_refused_before_connecting() -> None:
    wrapped = effectively_once(_never_connect)(lambda self, conn: "ran")
    task = types.SimpleNamespace(name="t.x", request=types.SimpleNamespace(id=None))
    with pytest.raises(ConsumerError, match="called directly"):
        wrapped(task)


def test_connect_must_return_a_psycopg_connection() -> None:
    wrapped = effectively_once(RecordingConnection)(  # type: ignore[arg-type]
        lambda self, conn: "ran"
    )
    task = types.SimpleNamespace(name="t.x", request=types.SimpleNamespace(id=str(TASK_ID)))
    with pytest.raises(ConsumerError, match="must return a psycopg 3 Connection"):
        wrapped(task)


def test_connect_must_be_callable() -> None:
    with pytest.raises(ConsumerError, match="callable"):
        effectively_once("postgresql://")  # type: ignore[call-overload]
