"""stage() refuses bad input before running any SQL (a recording fake connection)."""

from __future__ import annotations

import datetime as dt
import decimal
import subprocess
import sys
import uuid
from typing import Any

import pytest
from kombu.utils.json import dumps, loads

import drain
from drain.errors import StagingError, UnsupportedConnection
from drain.limits import MAX_EXPIRES
from tests import support


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
        ({"args": [object()]}, "args for t are not JSON-serialisable"),
        ({"kwargs": {"x": {1, 2}}}, "kwargs for t are not JSON-serialisable"),
        ({"args": [float("nan")]}, "args for t are not JSON-serialisable: .* NaN"),
        ({"kwargs": {"x": [float("-inf")]}}, "kwargs for t .* jsonb stores no NaN or infinity"),
        ({"args": ["a\x00b"]}, "NUL"),
        ({"args": [b"a\x00b"]}, "args for t contain a NUL"),
        ({"kwargs": {"x": "\ud800"}}, "kwargs for t is not valid Unicode"),
        ({"args": [support.nested(5000)]}, "args for t are nested too deeply"),
        ({"kwargs": {"x": support.nested(5000)}}, "kwargs for t are nested too deeply"),
        ({"args": [uuid.uuid4(), support.nested(5000)]}, "args for t are nested too deeply"),
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
        ({"countdown": 1e12}, "countdown for t is out of range"),
        ({"countdown": -1e12}, "countdown for t is out of range"),
        ({"expires": 1e12}, "expires for t is out of range"),
        ({"eta": dt.datetime.max.replace(tzinfo=dt.timezone(-dt.timedelta(hours=5)))},
         "eta for t is out of range"),
        ({"expires": dt.datetime.min.replace(tzinfo=dt.timezone(dt.timedelta(hours=5)))},
         "expires for t is out of range"),
        ({"expires": dt.datetime(2099, 1, 1)}, "expires for t is more than 3,650 days ahead"),
        ({"expires": dt.datetime.max}, "expires for t is more than 3,650 days ahead"),
        ({"expires": MAX_EXPIRES.total_seconds() + 60},
         "expires for t is more than 3,650 days ahead"),
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


def test_an_expiry_within_the_brokers_limit_is_staged() -> None:
    conn = RecordingConnection()
    drain.stage(conn, "t.x", expires=MAX_EXPIRES.total_seconds() - 60)
    drain.stage(conn, "t.x", expires=dt.datetime.now(dt.timezone.utc) + MAX_EXPIRES
                - dt.timedelta(minutes=1))
    drain.stage(conn, "t.x", expires=dt.datetime(2020, 1, 1))  # past: dead-lettered, expired
    drain.stage(conn, "t.x", eta=dt.datetime.max)  # not before: kept in Postgres, any time
    assert len(conn.cur.statements) == 4


@pytest.mark.parametrize("job", [
    drain.Job("t.x", expires=dt.datetime(2099, 1, 1)),
    {"task_name": "t.x", "expires": 400_000_000},
    drain.Job("t.x", countdown=1e12),
    drain.Job("t.x", args=[support.nested(5000)]),
], ids=["Job-expires", "mapping-expires", "countdown-overflow", "nested"])
def test_stage_many_refuses_the_same_before_any_sql(job: Any) -> None:
    conn = RecordingConnection()
    with pytest.raises(StagingError, match=r"for t\.x (is|are) "):
        drain.stage_many(conn, [drain.Job("ok"), job])
    assert conn.cur.statements == []


#: What kombu's JSON encoder carries besides plain JSON (kombu.utils.json).
KOMBU_VALUES: list[Any] = [
    uuid.UUID("7d3f0f7e-8f3a-4d51-9a49-1bd9b1b0c2aa"),
    dt.datetime(2026, 11, 27, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    dt.datetime(2026, 11, 27, 3, 4, 5),
    dt.date(2026, 11, 27),
    dt.time(3, 4, 5, 6),
    decimal.Decimal("1.10"),
    decimal.Decimal("NaN"),
    b"utf-8 bytes \xc3\xa9",
    b"\xff\xfe not utf-8",
    {"nested": [uuid.UUID(int=7), (dt.date(2000, 1, 1),)]},
]


def test_kombus_types_are_encoded_as_kombu_encodes_them() -> None:
    """Text equal to kombu.utils.json.dumps's, and kombu's decoder gives back the
    same values, as a worker's kombu does after delay()."""
    conn = RecordingConnection()
    drain.stage(conn, "t.x", KOMBU_VALUES, {"when": KOMBU_VALUES[1], "id": KOMBU_VALUES[0]})
    [(_, params)] = conn.cur.statements
    assert params["args0"] == dumps(KOMBU_VALUES, ensure_ascii=False)
    expected = [*KOMBU_VALUES[:-1], {"nested": [uuid.UUID(int=7), [dt.date(2000, 1, 1)]]}]
    decoded = loads(params["args0"])
    assert decoded[:6] == expected[:6] and decoded[6].is_nan()
    assert decoded[7:] == expected[7:]
    assert [type(v) for v in decoded] == [type(v) for v in expected]
    assert loads(params["kwargs0"]) == {"when": KOMBU_VALUES[1], "id": KOMBU_VALUES[0]}


def test_plain_json_never_imports_kombu() -> None:
    """drain.stage is on the application's hot path: plain JSON is encoded by the
    standard library alone; kombu (about 0.1 s to import) loads for its types only."""
    code = (
        "import sys, uuid, drain\n"
        "class C:\n"
        "    def cursor(self): return self\n"
        "    def execute(self, s, p=None): pass\n"
        "    def close(self): pass\n"
        "drain.stage(C(), 't', [1, 'a', None, 2.5, [True]], {'k': {'x': 'é'}})\n"
        "drain.stage_many(C(), [drain.Job('t', [1])])\n"
        "print('kombu' in sys.modules)\n"
        "drain.stage(C(), 't', [uuid.uuid4()])\n"
        "print('kombu' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]
