"""stage() refuses bad input before running any SQL (a recording fake connection)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest

import drain
from drain.errors import StagingError, UnsupportedConnection


class RecordingCursor:
    """A DB-API cursor that records statements instead of running them."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []

    def execute(self, statement: str, params: Any = None) -> None:
        self.statements.append((statement, params))

    def fetchone(self) -> None:
        return None

    def close(self) -> None:
        pass


class RecordingConnection:
    def __init__(self) -> None:
        self.cur = RecordingCursor()

    def cursor(self) -> RecordingCursor:
        return self.cur


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"task_name": ""}, "non-empty"),
        ({"task_name": "  "}, "non-empty"),
        ({"task_name": 5}, "non-empty"),
        ({"args": "abc"}, "list or tuple"),
        ({"args": {"a": 1}}, "list or tuple"),
        ({"kwargs": [1]}, "must be a dict"),
        ({"kwargs": {1: 2}}, "string keys"),
        ({"args": [dt.datetime(2026, 1, 1)]}, "not JSON-serialisable"),
        ({"kwargs": {"x": {1, 2}}}, "not JSON-serialisable"),
        ({"args": [float("nan")]}, "not JSON-serialisable"),
        ({"args": ["a\x00b"]}, "NUL"),
        ({"queue": ""}, "1 to 255 bytes"),
        ({"queue": "q" * 256}, "1 to 255 bytes"),
        ({"task_id": "not-a-uuid"}, "not a UUID"),
    ],
)
def test_rejected_before_any_sql(kwargs: dict[str, Any], fragment: str) -> None:
    conn = RecordingConnection()
    call: dict[str, Any] = {"task_name": "t", **kwargs}
    name = call.pop("task_name")
    with pytest.raises(StagingError, match=fragment):
        drain.stage(conn, name, **call)
    assert conn.cur.statements == []


def test_stage_many_validates_everything_first() -> None:
    conn = RecordingConnection()
    jobs: list[Any] = [drain.Job("ok", [1]), {"task_name": "ok2"}, drain.Job("bad", [object()])]
    with pytest.raises(StagingError, match="bad"):
        drain.stage_many(conn, jobs)
    assert conn.cur.statements == []
    with pytest.raises(StagingError, match="unknown field"):
        drain.stage_many(conn, [{"task_name": "x", "eta": 5}])


def test_dbapi_statement_and_params() -> None:
    conn = RecordingConnection()
    task_id = uuid.uuid4()
    returned = drain.stage(conn, "t.x", (1, 2), {"k": "é"}, queue="q", task_id=str(task_id))
    assert returned == task_id
    [(statement, params)] = conn.cur.statements
    assert statement.startswith("INSERT INTO staged_jobs (task_id, task_name, args, kwargs, queue)")
    assert params == {
        "task_id0": str(task_id), "task_name0": "t.x", "args0": "[1, 2]",
        "kwargs0": '{"k": "é"}', "queue0": "q",
    }


def test_unsupported_connection() -> None:
    with pytest.raises(UnsupportedConnection, match=r"cannot stage on a builtins\.str"):
        drain.stage("not a connection", "t")


class AsyncConnection:
    """Stands in for psycopg's / SQLAlchemy's async connections."""

    async def execute(self, statement: str, params: Any = None) -> None:  # pragma: no cover
        raise AssertionError("must not be called")

    def cursor(self) -> RecordingCursor:  # pragma: no cover
        raise AssertionError("must not be called")


def test_async_connections_are_refused_not_silently_ignored() -> None:
    with pytest.raises(UnsupportedConnection, match="asynchronous"):
        drain.stage(AsyncConnection(), "t")
    with pytest.raises(UnsupportedConnection, match="asynchronous"):
        drain.stage_many(AsyncConnection(), [drain.Job("t")])
