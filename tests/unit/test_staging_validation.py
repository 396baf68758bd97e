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
        ({"priority": 40000}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"priority": True}, "priority"),
        ({"tag": ""}, "tag"),
        ({"tag": "t" * 256}, "tag"),
        ({"countdown": 5, "eta": dt.datetime(2030, 1, 1)}, "not both"),
        ({"countdown": "soon"}, "number of seconds"),
        ({"countdown": float("nan")}, "number of seconds"),
        ({"eta": "2030-01-01"}, "must be a datetime"),
        ({"expires": "later"}, "number of seconds"),
        ({"countdown": 1e30}, "out of range"),
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
        drain.stage_many(conn, [{"task_name": "x", "delay": 5}])


def test_dbapi_statement_and_params() -> None:
    conn = RecordingConnection()
    task_id = uuid.uuid4()
    eta = dt.datetime(2030, 1, 2, 3, 4, 5)  # naive: UTC
    returned = drain.stage(conn, "t.x", (1, 2), {"k": "é"}, queue="q", task_id=str(task_id),
                           priority=-3, tag="api.x", eta=eta,
                           expires=dt.datetime(2030, 1, 3, tzinfo=dt.timezone.utc))
    assert returned == task_id
    [(statement, params)] = conn.cur.statements
    assert statement.startswith(
        "INSERT INTO staged_jobs (task_id, task_name, args, kwargs, queue, priority, tag, "
        "not_before, expires_at) VALUES (CAST(%(task_id0)s AS uuid)"
    )
    assert params == {
        "task_id0": str(task_id), "task_name0": "t.x", "args0": "[1, 2]",
        "kwargs0": '{"k": "é"}', "queue0": "q", "priority0": "-3", "tag0": "api.x",
        "not_before0": "2030-01-02T03:04:05+00:00", "expires_at0": "2030-01-03T00:00:00+00:00",
    }


def test_countdown_and_relative_expiry_are_from_now() -> None:
    conn = RecordingConnection()
    before = dt.datetime.now(dt.timezone.utc)
    drain.stage(conn, "t.x", countdown=60, expires=3600)
    after = dt.datetime.now(dt.timezone.utc)
    [(_, params)] = conn.cur.statements
    not_before = dt.datetime.fromisoformat(str(params["not_before0"]))
    expires_at = dt.datetime.fromisoformat(str(params["expires_at0"]))
    assert before + dt.timedelta(seconds=60) <= not_before <= after + dt.timedelta(seconds=60)
    assert before + dt.timedelta(hours=1) <= expires_at <= after + dt.timedelta(hours=1)
    assert params["tag0"] is None and params["priority0"] == "0"


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
