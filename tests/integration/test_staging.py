"""drain.stage / drain.stage_many on real connections of every supported kind.

* psycopg 3 Connection and Cursor, SQLAlchemy 2 Connection and Session, and
  Django's connection stage inside the caller's transaction: the job appears
  exactly when that transaction commits and never if it rolls back; stage()
  never commits by itself.
* stage_many stages large batches (COPY on psycopg, chunked multi-row INSERT
  on SQLAlchemy) and returns the task ids in input order.
* Bad input raises StagingError, writes nothing and leaves the caller's
  transaction usable.
* Tricky text round-trips exactly through jsonb and the text columns.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy
from kombu.utils.json import loads
from sqlalchemy.orm import Session

import drain
from drain.limits import MAX_EXPIRATION_MS
from drain.postgres import sql
from tests import roles, support


def rows(url: str, where: str = "TRUE") -> list[tuple[Any, ...]]:
    """(task_id, task_name, args, kwargs, queue) of the staged rows, in id order."""
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT task_id, task_name, args, kwargs, queue FROM staged_jobs "
            f"WHERE {where} ORDER BY id"
        ).fetchall()


def ids_by_first_arg(url: str) -> dict[Any, uuid.UUID]:
    return {args[0]: task_id for task_id, _, args, _, _ in rows(url)}


# -- psycopg ---------------------------------------------------------------------------


def test_psycopg_commit_and_rollback(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        task_id = drain.stage(conn, "t.commit", [1, "a"], {"k": [None, True]}, queue="q1")
        conn.commit()
        drain.stage(conn, "t.rollback", [2])
        conn.rollback()
    assert isinstance(task_id, uuid.UUID)
    assert rows(db_url) == [(task_id, "t.commit", [1, "a"], {"k": [None, True]}, "q1")]


def test_stage_never_commits_by_itself(db_url: str) -> None:
    with (
        psycopg.connect(db_url) as conn,
        psycopg.connect(db_url, autocommit=True) as other,
    ):
        task_id = drain.stage(conn, "t.pending")
        drain.stage_many(conn, [drain.Job("t.pending_many")])
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert other.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,)

        conn.commit()
        assert other.execute("SELECT count(*) FROM staged_jobs").fetchone() == (2,)
    assert rows(db_url)[0][:2] == (task_id, "t.pending")


def test_psycopg_cursor(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        with conn.cursor() as cur:
            one = drain.stage(cur, "t.cursor", [1])
            many = drain.stage_many(cur, [drain.Job("t.cursor_many", [2])])
        conn.commit()
        with conn.cursor() as cur:
            drain.stage(cur, "t.cursor_rolled_back")
            drain.stage_many(cur, [drain.Job("t.cursor_rolled_back")])
        conn.rollback()
    assert [(r[0], r[1], r[2]) for r in rows(db_url)] == [
        (one, "t.cursor", [1]), (many[0], "t.cursor_many", [2]),
    ]


@pytest.mark.parametrize("as_str", [True, False])
def test_explicit_task_id(db_url: str, as_str: bool) -> None:
    given, given_many = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(db_url) as conn:
        returned = drain.stage(conn, "t.id", task_id=str(given) if as_str else given)
        returned_many = drain.stage_many(
            conn, [{"task_name": "t.id_many", "task_id": str(given_many) if as_str else given_many}]
        )
    assert (returned, returned_many) == (given, [given_many])
    assert [(r[0], r[1]) for r in rows(db_url)] == [(given, "t.id"), (given_many, "t.id_many")]


# -- SQLAlchemy ------------------------------------------------------------------------


@pytest.fixture
def engine(db_url: str) -> Iterator[sqlalchemy.Engine]:
    url = db_url.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = sqlalchemy.create_engine(url)
    yield engine
    engine.dispose()


def test_sqlalchemy_connection(db_url: str, engine: sqlalchemy.Engine) -> None:
    with engine.begin() as conn:
        committed = drain.stage(conn, "t.sa_commit", [1], {"k": "v"}, queue="sa")
    with engine.connect() as conn:
        drain.stage(conn, "t.sa_rollback", [2])
        conn.rollback()
    with engine.connect() as conn:
        drain.stage(conn, "t.sa_closed_without_commit", [3])
    assert rows(db_url) == [(committed, "t.sa_commit", [1], {"k": "v"}, "sa")]


def test_sqlalchemy_session(db_url: str, engine: sqlalchemy.Engine) -> None:
    with Session(engine) as session:
        committed = drain.stage(session, "t.session_commit", [1])
        session.commit()
        drain.stage(session, "t.session_rollback", [2])
        session.rollback()
    assert [(r[0], r[1]) for r in rows(db_url)] == [(committed, "t.session_commit")]


# -- Django ----------------------------------------------------------------------------


class Abort(Exception):
    """Raised to roll back an atomic() block."""


def test_django_atomic(django_db: str) -> None:
    from django.db import connection, transaction

    committed_name, aborted_name = support.unique("t.dj_commit"), support.unique("t.dj_abort")
    with transaction.atomic():
        committed = drain.stage(connection, committed_name, [1], {"k": "v"})
    with pytest.raises(Abort), transaction.atomic():
        drain.stage(connection, aborted_name, [2])
        drain.stage_many(connection, [drain.Job(aborted_name, [3])])
        raise Abort
    assert connection.vendor == "postgresql"
    assert rows(django_db, f"task_name IN ('{committed_name}', '{aborted_name}')") == [
        (committed, committed_name, [1], {"k": "v"}, None),
    ]


def test_django_stage_many(django_db: str) -> None:
    from django.db import connection, transaction

    name = support.unique("t.dj_many")
    with transaction.atomic():
        ids = drain.stage_many(connection, [drain.Job(name, [i]) for i in range(1234)])
    staged = rows(django_db, f"task_name = '{name}'")
    assert [r[0] for r in staged] == ids
    assert [r[2] for r in staged] == [[i] for i in range(1234)]


# -- stage_many --------------------------------------------------------------------------


def test_stage_many_copy_10000(db_url: str) -> None:
    jobs = [drain.Job("t.bulk", [i], {"n": i}) for i in range(10_000)]
    with psycopg.connect(db_url) as conn:
        ids = drain.stage_many(conn, jobs)
    by_arg = ids_by_first_arg(db_url)
    assert len(ids) == len(set(ids)) == len(by_arg) == 10_000
    assert set(ids) == set(by_arg.values())
    assert all(by_arg[i] == ids[i] for i in range(10_000))


def test_stage_many_sqlalchemy_chunks(db_url: str, engine: sqlalchemy.Engine) -> None:
    jobs = [{"task_name": "t.sa_bulk", "args": [i]} for i in range(1234)]
    with engine.begin() as conn:
        ids = drain.stage_many(conn, jobs)
    with Session(engine) as session:
        session_ids = drain.stage_many(session, [drain.Job("t.session_bulk", [-1])])
        session.commit()
    by_arg = ids_by_first_arg(db_url)
    assert len(by_arg) == 1235
    assert [by_arg[i] for i in range(1234)] == ids
    assert [by_arg[-1]] == session_ids


def test_stage_many_mixes_jobs_and_mappings(db_url: str) -> None:
    given = uuid.uuid4()
    jobs: list[drain.Job | dict[str, Any]] = [
        drain.Job("t.job", (1, 2), {"a": 1}, queue="qa"),
        {"task_name": "t.dict", "args": [3], "kwargs": {"b": 2}, "task_id": given},
        drain.Job("t.job_defaults"),
        {"task_name": "t.dict_defaults", "queue": None, "kwargs": None, "args": None},
    ]
    with psycopg.connect(db_url) as conn:
        ids = drain.stage_many(conn, jobs)
    assert ids[1] == given
    assert rows(db_url) == [
        (ids[0], "t.job", [1, 2], {"a": 1}, "qa"),
        (given, "t.dict", [3], {"b": 2}, None),
        # No queue given: NULL (the drain routes it with --app, else sends it to celery).
        (ids[2], "t.job_defaults", [], {}, None),
        (ids[3], "t.dict_defaults", [], {}, None),
    ]


def test_stage_many_empty(db_url: str, engine: sqlalchemy.Engine) -> None:
    with psycopg.connect(db_url) as conn:
        assert drain.stage_many(conn, []) == []
        assert drain.stage_many(conn, iter(())) == []
    with engine.begin() as sa_conn:
        assert drain.stage_many(sa_conn, []) == []
    assert rows(db_url) == []


# -- bad input -----------------------------------------------------------------------------

BAD_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("set in args", {"task_name": "t.bad", "args": [{1, 2}]}),
    ("expires beyond the broker's limit", {"task_name": "t.bad",
                                           "expires": dt.datetime(2099, 1, 1)}),
    ("countdown out of range", {"task_name": "t.bad", "countdown": 1e12}),
    ("args nested too deeply", {"task_name": "t.bad", "args": [support.nested(5000)]}),
    ("lone surrogate in args", {"task_name": "t.bad", "args": ["\udcff"]}),
    ("lone surrogate in kwargs key", {"task_name": "t.bad", "kwargs": {"\ud800": 1}}),
    ("lone surrogate in task name", {"task_name": "t.bad\ud800"}),
    ("lone surrogate in queue", {"task_name": "t.bad", "queue": "q\udc80"}),
    ("NUL in task name", {"task_name": "t.bad\x00"}),
    ("NUL in queue", {"task_name": "t.bad", "queue": "q\x00"}),
    ("NUL in kwargs", {"task_name": "t.bad", "kwargs": {"k": "a\x00b"}}),
]


def _stage_bad(conn: Any, call: dict[str, Any], many: bool) -> None:
    if many:
        drain.stage_many(conn, [drain.Job("t.good_sibling", [0]), call])
    else:
        call = dict(call)
        drain.stage(conn, call.pop("task_name"), **call)


@pytest.mark.parametrize("many", [False, True], ids=["stage", "stage_many"])
@pytest.mark.parametrize(("what", "call"), BAD_CALLS, ids=[w for w, _ in BAD_CALLS])
def test_bad_input_leaves_the_transaction_usable(
    db_url: str, what: str, call: dict[str, Any], many: bool
) -> None:
    with psycopg.connect(db_url) as conn:
        before = drain.stage(conn, "t.before")
        with pytest.raises(drain.StagingError):
            _stage_bad(conn, call, many)
        after = drain.stage(conn, "t.after")
        conn.commit()
    assert [(r[0], r[1]) for r in rows(db_url)] == [(before, "t.before"), (after, "t.after")]


@pytest.mark.parametrize("many", [False, True], ids=["stage", "stage_many"])
def test_bad_input_sqlalchemy(db_url: str, engine: sqlalchemy.Engine, many: bool) -> None:
    with engine.begin() as conn:
        with pytest.raises(drain.StagingError):
            _stage_bad(conn, BAD_CALLS[0][1], many)
        good = drain.stage(conn, "t.after")
    assert [(r[0], r[1]) for r in rows(db_url)] == [(good, "t.after")]


# -- round trip ---------------------------------------------------------------------------

TRICKY = [
    "it's \"quoted\" `back`",
    "back\\slash \\\\ and \\N and \\t and a trailing backslash \\",
    r"a literal \u0000 escape, not a NUL",
    "new\nline\r\ncrlf\ttab\x0bvt\x0cff",
    "émoji 🎉👩‍👩‍👧 ünïcødé 日本語 ☃",
    "separators \u2028 \u2029 \x85 nbsp\xa0 bom\ufeff",
    "\x01\x1f control characters",
    "",
    "   ",
]
TRICKY_ARGS: list[Any] = [*TRICKY, 2**63 - 1, -0.5, 0.1, None, True, [[], {}], {"\n": "\\"}]
TRICKY_KWARGS: dict[str, Any] = {text: text for text in TRICKY} | {"nested": {"list": TRICKY}}
TRICKY_NAME = "tâsk.ñame 'q' \"dq\" \\ \t 🎉 \u2028"
TRICKY_QUEUE = "qüeue \\N \t\n 🎉"


def test_tricky_values_round_trip(db_url: str, engine: sqlalchemy.Engine) -> None:
    expected = (TRICKY_NAME, TRICKY_ARGS, TRICKY_KWARGS, TRICKY_QUEUE)
    with psycopg.connect(db_url) as conn:
        ids = [drain.stage(conn, *expected[:3], queue=TRICKY_QUEUE)]  # INSERT
        ids += drain.stage_many(conn, [drain.Job(*expected)])  # COPY
    with engine.begin() as sa_conn:
        ids.append(drain.stage(sa_conn, *expected[:3], queue=TRICKY_QUEUE))

    staged = rows(db_url)
    assert [r[0] for r in staged] == ids
    for row in staged:
        assert row[1:] == expected
    # The JSON text the drain publishes decodes to the same values.
    with psycopg.connect(db_url) as conn:
        texts = conn.execute("SELECT args::text, kwargs::text FROM staged_jobs").fetchall()
    for args_text, kwargs_text in texts:
        assert (json.loads(args_text), json.loads(kwargs_text)) == (TRICKY_ARGS, TRICKY_KWARGS)


# -- what kombu's JSON carries ----------------------------------------------------------

KOMBU_ARGS: list[Any] = [
    uuid.UUID("7d3f0f7e-8f3a-4d51-9a49-1bd9b1b0c2aa"),
    dt.datetime(2026, 11, 27, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=-3))),
    dt.date(2026, 11, 27), dt.time(23, 59, 59, 999999), decimal.Decimal("-0.000100"),
    b"bytes \xc3\xa9", b"\x80\xff base64", {"in": [decimal.Decimal("1E+3")]},
]


def test_kombus_types_round_trip_through_jsonb(db_url: str, engine: sqlalchemy.Engine) -> None:
    """INSERT (psycopg, SQLAlchemy) and COPY: the JSON text the drain publishes
    decodes, by kombu's decoder as in the worker, to the values given (jsonb
    reorders an object's keys; kombu's object hook does not mind)."""
    kwargs = {"id": KOMBU_ARGS[0], "at": KOMBU_ARGS[1]}
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.kombu", KOMBU_ARGS, kwargs)
        drain.stage_many(conn, [drain.Job("t.kombu", KOMBU_ARGS, kwargs)] * 2)  # COPY
    with engine.begin() as sa_conn:
        drain.stage_many(sa_conn, [drain.Job("t.kombu", KOMBU_ARGS, kwargs)])  # multi-row
    with psycopg.connect(db_url) as conn:
        texts = conn.execute("SELECT args::text, kwargs::text FROM staged_jobs").fetchall()
    assert len(texts) == 4
    for args_text, kwargs_text in texts:
        assert loads(args_text) == KOMBU_ARGS
        assert [type(v) for v in loads(args_text)] == [type(v) for v in KOMBU_ARGS]
        assert loads(kwargs_text) == kwargs


# -- drain_stage() -----------------------------------------------------------------------


@pytest.mark.parametrize(("call", "sqlstate", "says"), [
    ("expires_at => now() + interval '3651 days'", "22023", "more than 3,650 days ahead"),
    ("expires_at => '2099-01-01'", "22023", "more than 3,650 days ahead"),
    ("expires_at => 'infinity'", "22008", "expires_at infinity is not a time"),
    ("expires_at => '-infinity'", "22008", "expires_at -infinity is not a time"),
    ("not_before => 'infinity'", "22008", "not_before infinity is not a time"),
    ("not_before => '10000-01-01'", "22008", "not_before 10000-01-01"),
    ("not_before => '0001-12-31 23:00:00+00 BC'", "22008", "not_before 0001-12-31"),
], ids=["3651-days", "2099", "infinity", "minus-infinity", "not-before-infinity",
        "year-10000", "before-year-1"])
def test_drain_stage_refuses_what_could_never_be_sent(
    db_url: str, call: str, sqlstate: str, says: str
) -> None:
    """As the application's role: the exception fails its statement, so its
    transaction, as apply_async raising would; nothing is staged."""
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        with pytest.raises(psycopg.Error, match=re.escape(says)) as raised:
            conn.execute(f"SELECT drain_stage('t.sql', {call})")
        assert raised.value.sqlstate == sqlstate
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    assert rows(db_url) == []


def test_drain_stage_takes_every_time_the_drain_can_send(db_url: str) -> None:
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        for call in ("expires_at => now() + interval '3649 days'",
                     "expires_at => '2000-01-01'",  # already expired: dead-lettered
                     "not_before => '9999-12-31 23:59:59+00'",
                     "not_before => '0001-01-01 00:00:00+00', expires_at => NULL"):
            conn.execute(f"SELECT drain_stage('t.sql', {call})")
    assert len(rows(db_url)) == 4


def test_drain_stage_checks_the_limit_drain_limits_names() -> None:
    """The SQL function's limit is drain.limits's, in seconds."""
    assert f"interval '{MAX_EXPIRATION_MS // 1000} seconds'" in sql.schema_text()


def test_the_stage_command_refuses_an_expiry_beyond_the_brokers_limit(db_url: str) -> None:
    for flag, value, says in (("--expires", "315400000", "expires for t.cli is more than "
                               "3,650 days ahead"),
                              ("--countdown", "1e12", "countdown for t.cli is out of range")):
        ran = support.run_cli(db_url, "stage", "t.cli", flag, value)
        assert ran.returncode == 2, ran.stderr
        assert ran.stderr.startswith(f"drain: error: {says}") and ran.stderr.count("\n") == 1
    assert rows(db_url) == []
