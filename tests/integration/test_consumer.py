"""drain.consumer against a real Postgres.

* claim() records a task id inside the caller's transaction: True the first
  time, False in every later transaction; a rolled-back claim leaves nothing
  behind and can be claimed again; it refuses to autocommit a claim on its own.
* Two transactions claiming the same id at once: the second blocks on the
  first (observed through pg_blocking_pids, not guessed with a sleep) and gets
  False once the first commits, True if the first rolls back.
* purge() deletes only rows older than the cutoff, in batches that are
  separate DELETE statements in separate transactions (logged by a trigger),
  and refuses to commit a caller's open transaction.
* claim() and purge() work on SQLAlchemy connections and sessions too;
  claim() refuses SQLAlchemy AUTOCOMMIT and Django's connection outside
  atomic(), where its record would commit before the work.
* effectively_once() runs a task body once per task id with its writes in the
  claim's transaction, skips (and logs, and calls on_skip for) a repeat, rolls
  the claim back with a failing body, and refuses a connection that is
  already inside a transaction, and a body (or on_skip) that returns with its
  transaction aborted by a database error it caught (a savepoint is fine).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import types
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy
from sqlalchemy.orm import Session

from drain.consumer import (
    AbortedTransactionError,
    ConsumerError,
    claim,
    effectively_once,
    purge,
)
from tests import support


def processed(url: str) -> set[uuid.UUID]:
    with psycopg.connect(url) as conn:
        return {row[0] for row in conn.execute("SELECT task_id FROM drain_processed")}


def fake_task(task_id: uuid.UUID | str | None, name: str = "t.index") -> Any:
    """What effectively_once reads of a bound Celery task."""
    return types.SimpleNamespace(name=name, request=types.SimpleNamespace(id=task_id))


# -- claim -------------------------------------------------------------------------


def test_claim_true_once_then_false_in_later_transactions(db_url: str) -> None:
    task_id = uuid.uuid4()
    with psycopg.connect(db_url) as conn:
        assert claim(conn, task_id) is True
        assert claim(conn, task_id) is False  # same transaction: the row is there
        conn.commit()
        assert claim(conn, str(task_id)) is False
        conn.commit()
    with psycopg.connect(db_url) as other:
        assert claim(other, str(task_id).upper()) is False
        assert claim(other, uuid.uuid4()) is True
    assert task_id in processed(db_url)


def test_claim_never_commits_and_a_rolled_back_claim_can_be_claimed_again(db_url: str) -> None:
    task_id = uuid.uuid4()
    with psycopg.connect(db_url) as conn:
        assert claim(conn, task_id) is True
        assert processed(db_url) == set()  # not visible: claim() did not commit
        conn.rollback()
        assert processed(db_url) == set()
        assert claim(conn, task_id) is True
        conn.commit()
    assert processed(db_url) == {task_id}


def test_claim_on_a_psycopg_cursor_and_inside_an_autocommit_transaction(db_url: str) -> None:
    first, second = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(db_url, autocommit=True) as conn:
        with pytest.raises(ConsumerError, match="autocommit"):
            claim(conn, first)
        with pytest.raises(ConsumerError, match="autocommit"), conn.cursor() as cursor:
            claim(cursor, first)
        assert processed(db_url) == set()
        with conn.transaction():
            assert claim(conn, first) is True
        with conn.transaction(), conn.cursor() as cursor:
            assert claim(cursor, second) is True
            assert claim(cursor, first) is False
    assert processed(db_url) == {first, second}


def _blocked_by(observer: psycopg.Connection[Any], pid: int) -> list[int]:
    row = observer.execute("SELECT pg_blocking_pids(%s)", (pid,)).fetchone()
    assert row is not None
    return list(row[0])


@pytest.mark.parametrize(("first_ends", "second_claims"), [("commit", False), ("rollback", True)])
def test_concurrent_claims_of_one_id_wait_for_the_first_transaction(
    db_url: str, first_ends: str, second_claims: bool
) -> None:
    task_id = uuid.uuid4()
    with (
        psycopg.connect(db_url) as first,
        psycopg.connect(db_url) as second,
        psycopg.connect(db_url, autocommit=True) as observer,
    ):
        assert claim(first, task_id) is True  # its transaction stays open
        result: dict[str, Any] = {}

        def second_delivery() -> None:
            try:
                result["claimed"] = claim(second, task_id)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=second_delivery, daemon=True)
        thread.start()
        support.wait_for(
            lambda: _blocked_by(observer, second.info.backend_pid) == [first.info.backend_pid],
            10,
            "the second claim to wait on the first transaction",
        )
        assert thread.is_alive()
        assert result == {}
        getattr(first, first_ends)()
        thread.join(10)
        assert not thread.is_alive()
        assert result == {"claimed": second_claims}
        second.commit()
    assert processed(db_url) == {task_id}


# -- purge -------------------------------------------------------------------------


_PURGE_LOG = """
CREATE TABLE purge_log (seq int GENERATED ALWAYS AS IDENTITY, xid bigint, deleted int);
CREATE FUNCTION log_purge() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO purge_log (xid, deleted) SELECT txid_current(), count(*) FROM old_rows;
    RETURN NULL;
END
$$;
CREATE TRIGGER log_purge AFTER DELETE ON drain_processed
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION log_purge();
"""


def _insert_processed(conn: psycopg.Connection[Any], count: int, age: str) -> None:
    conn.execute(
        "INSERT INTO drain_processed (task_id, processed_at) "
        "SELECT gen_random_uuid(), now() - CAST(%s AS interval) FROM generate_series(1, %s)",
        (age, count),
    )


def test_purge_deletes_only_old_rows_in_batches_of_separate_transactions(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(_PURGE_LOG)
        _insert_processed(conn, 25_000, "10 days")
        _insert_processed(conn, 3, "7 days 1 minute")
        _insert_processed(conn, 5, "6 days 23 hours")
        _insert_processed(conn, 7, "0 seconds")
        conn.commit()

        assert purge(conn, dt.timedelta(days=7), batch_size=10_000) == 25_003
        rows = conn.execute("SELECT xid, deleted FROM purge_log ORDER BY seq").fetchall()
        assert [deleted for _, deleted in rows] == [10_000, 10_000, 5_003]
        assert len({xid for xid, _ in rows}) == 3  # one transaction per batch
        left = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE processed_at < now() - interval '7 days') "
            "FROM drain_processed"
        ).fetchone()
        assert left == (12, 0)
        conn.commit()

        assert purge(conn, dt.timedelta(days=7)) == 0
        assert purge(conn, dt.timedelta(hours=1)) == 5
        remaining = conn.execute("SELECT count(*) FROM drain_processed").fetchone()
        assert remaining == (7,)


def test_purge_refuses_to_commit_the_callers_transaction(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        _insert_processed(conn, 2, "30 days")  # uncommitted work of the caller
        with pytest.raises(ConsumerError, match="transaction in progress"):
            purge(conn, dt.timedelta(days=1))
        conn.rollback()
        assert processed(db_url) == set()
        _insert_processed(conn, 2, "30 days")
        conn.commit()
        assert purge(conn, dt.timedelta(days=1)) == 2
    with psycopg.connect(db_url, autocommit=True) as conn:
        _insert_processed(conn, 3, "30 days")
        assert purge(conn, dt.timedelta(days=1), batch_size=2) == 3
    assert processed(db_url) == set()


# -- SQLAlchemy ----------------------------------------------------------------------


@pytest.fixture
def engine(db_url: str) -> Iterator[sqlalchemy.Engine]:
    engine = sqlalchemy.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    yield engine
    engine.dispose()


def test_claim_and_purge_on_sqlalchemy(db_url: str, engine: sqlalchemy.Engine) -> None:
    task_id = uuid.uuid4()
    with Session(engine) as session:
        assert claim(session, task_id) is True
        session.rollback()
        assert claim(session, task_id) is True
        session.commit()
        assert claim(session, task_id) is False
        session.rollback()
    with engine.connect() as conn:
        assert claim(conn, str(task_id)) is False
        conn.rollback()
        conn.execute(
            sqlalchemy.text(
                "INSERT INTO drain_processed (task_id, processed_at) "
                "SELECT gen_random_uuid(), now() - interval '9 days' FROM generate_series(1, 5)"
            )
        )
        conn.commit()
        assert purge(conn, dt.timedelta(days=8), batch_size=2) == 5
    assert processed(db_url) == {task_id}


# -- effectively_once ----------------------------------------------------------------


@pytest.fixture
def worker_conn(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """Like celery_app's: one autocommit connection the task borrows every time."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (task_id uuid, annotation_id int)")
        yield conn


def effects(url: str) -> list[tuple[uuid.UUID, int]]:
    with psycopg.connect(url) as conn:
        return [(r[0], r[1]) for r in conn.execute("SELECT task_id, annotation_id FROM effects")]


def test_body_runs_once_per_task_id_and_repeats_are_skipped(
    db_url: str, worker_conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    skips: list[tuple[Any, ...]] = []

    def on_skip(task: Any, conn: psycopg.Connection[Any], annotation_id: int) -> None:
        assert conn is worker_conn
        assert conn.info.transaction_status.name == "INTRANS"
        skips.append((task.request.id, annotation_id))

    @effectively_once(lambda: worker_conn, on_skip=on_skip)
    def index(task: Any, conn: psycopg.Connection[Any], annotation_id: int) -> str:
        assert conn.info.transaction_status.name == "INTRANS"
        # Inside the claim's transaction: the claim is visible here, not elsewhere.
        mine = uuid.UUID(str(task.request.id))
        assert mine not in processed(db_url)
        assert conn.execute("SELECT 1 FROM drain_processed WHERE task_id = %s", (mine,)).fetchone()
        conn.execute("INSERT INTO effects VALUES (%s, %s)", (task.request.id, annotation_id))
        return f"indexed {annotation_id}"

    task_id = uuid.uuid4()
    caplog.set_level(logging.INFO, logger="drain.consumer")
    assert index(fake_task(str(task_id)), 7) == "indexed 7"
    assert effects(db_url) == [(task_id, 7)]
    assert processed(db_url) == {task_id}
    assert skips == []

    assert index(fake_task(str(task_id)), annotation_id=7) is None
    assert index(fake_task(task_id), 7) is None
    assert effects(db_url) == [(task_id, 7)]
    assert skips == [(str(task_id), 7), (task_id, 7)]
    assert f"task t.index[{task_id}] already processed; skipped" in caplog.messages

    other = uuid.uuid4()
    assert index(fake_task(other), 7) == "indexed 7"
    assert effects(db_url) == [(task_id, 7), (other, 7)]
    assert worker_conn.info.transaction_status.name == "IDLE"


def test_a_failing_body_rolls_back_its_claim_and_writes(
    db_url: str, worker_conn: psycopg.Connection[Any]
) -> None:
    attempts: list[int] = []

    @effectively_once(lambda: worker_conn)
    def flaky(task: Any, conn: psycopg.Connection[Any], annotation_id: int) -> None:
        attempts.append(annotation_id)
        conn.execute("INSERT INTO effects VALUES (%s, %s)", (task.request.id, annotation_id))
        if len(attempts) == 1:
            raise RuntimeError("search engine down")

    task_id = uuid.uuid4()
    with pytest.raises(RuntimeError, match="search engine down"):
        flaky(fake_task(task_id), 3)
    assert processed(db_url) == set()
    assert effects(db_url) == []
    flaky(fake_task(task_id), 3)  # the redelivery / retry runs it again
    flaky(fake_task(task_id), 3)  # and then it is done
    assert attempts == [3, 3]
    assert effects(db_url) == [(task_id, 3)]
    assert processed(db_url) == {task_id}


def test_non_autocommit_connection_and_context_manager_sources(db_url: str) -> None:
    exits: list[str] = []

    @contextlib.contextmanager
    def pooled() -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(db_url) as conn:  # not autocommit
            yield conn
        exits.append("closed")

    @effectively_once(pooled)
    def body(task: Any, conn: psycopg.Connection[Any]) -> int:
        return 1

    task_id = uuid.uuid4()
    assert body(fake_task(task_id)) == 1
    assert exits == ["closed"]
    assert processed(db_url) == {task_id}  # committed, not left to the pool
    assert body(fake_task(task_id)) is None
    assert exits == ["closed", "closed"]

    with psycopg.connect(db_url) as plain:
        again = effectively_once(lambda: plain)(lambda task, conn: 2)
        other = uuid.uuid4()
        assert again(fake_task(other)) == 2
        assert plain.info.transaction_status.name == "IDLE"
    assert processed(db_url) == {task_id, other}


def test_a_connection_inside_a_transaction_is_refused(db_url: str) -> None:
    ran: list[bool] = []
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT 1")  # an implicit transaction is now open

        @effectively_once(lambda: conn)
        def body(task: Any, conn: psycopg.Connection[Any]) -> None:
            ran.append(True)

        with pytest.raises(ConsumerError, match=r"transaction in progress \(INTRANS\)"):
            body(fake_task(uuid.uuid4()))
        conn.rollback()
    assert ran == []
    assert processed(db_url) == set()


def test_a_bad_task_id_is_refused_before_any_sql(
    db_url: str, worker_conn: psycopg.Connection[Any]
) -> None:
    @effectively_once(lambda: worker_conn)
    def body(task: Any, conn: psycopg.Connection[Any]) -> None:
        raise AssertionError("must not run")

    with pytest.raises(ConsumerError, match="not a UUID"):
        body(fake_task("celery-custom-id"))
    assert processed(db_url) == set()


def test_a_closed_connection_is_refused(db_url: str) -> None:
    conn = psycopg.connect(db_url, autocommit=True)
    conn.close()
    body = effectively_once(lambda: conn)(lambda task, conn: "ran")
    with pytest.raises(ConsumerError, match="closed connection"):
        body(fake_task(uuid.uuid4()))


# -- refusals: what would lose a job -------------------------------------------------


def test_claim_refuses_sqlalchemy_autocommit(db_url: str) -> None:
    """Before: claim() returned True and its row was committed at once, so a
    rollback of the work left it behind and the redelivery skipped the work."""
    url = db_url.replace("postgresql://", "postgresql+psycopg://", 1)
    auto = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
    plain = sqlalchemy.create_engine(url)
    try:
        with auto.connect() as conn, pytest.raises(ConsumerError, match="AUTOCOMMIT mode"):
            claim(conn, uuid.uuid4())
        with auto.connect() as conn, conn.begin(), pytest.raises(ConsumerError, match="AUTOCOMMIT"):
            claim(conn, uuid.uuid4())  # begin() opens no database transaction there
        with Session(auto) as session, pytest.raises(ConsumerError, match="AUTOCOMMIT"):
            claim(session, uuid.uuid4())
        with plain.connect() as conn:
            per_connection = conn.execution_options(isolation_level="AUTOCOMMIT")
            with pytest.raises(ConsumerError, match="AUTOCOMMIT"):
                claim(per_connection, uuid.uuid4())
        assert processed(db_url) == set()
        kept = uuid.uuid4()
        with plain.connect() as conn:  # the ordinary way still works
            assert claim(conn, kept) is True
            conn.rollback()
            assert claim(conn, kept) is True
            conn.commit()
    finally:
        auto.dispose()
        plain.dispose()
    assert processed(db_url) == {kept}


def test_claim_refuses_django_outside_atomic(django_db: str) -> None:
    """Before: claim(connection, id) outside atomic() committed its row on its own."""
    from django.db import connection, transaction

    refused, kept, rolled_back = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    with pytest.raises(ConsumerError, match=r"outside transaction\.atomic\(\)"):
        claim(connection, refused)
    with connection.cursor() as cursor, pytest.raises(ConsumerError, match="atomic"):
        claim(cursor, refused)
    with transaction.atomic():
        assert claim(connection, kept) is True
    with contextlib.suppress(RuntimeError), transaction.atomic():
        assert claim(connection, rolled_back) is True
        raise RuntimeError("the work failed")
    with transaction.atomic(), connection.cursor() as cursor:
        assert claim(cursor, kept) is False
        assert claim(cursor, rolled_back) is True  # the redelivery does the work
    assert processed(django_db) >= {kept, rolled_back}
    assert refused not in processed(django_db)


def _swallowing(connect: Any, ran: list[str]) -> Any:
    """A body in the common idiom: INSERT, and let a duplicate pass."""

    @effectively_once(connect)
    def index(task: Any, conn: psycopg.Connection[Any], annotation_id: int) -> str:
        conn.execute("INSERT INTO effects VALUES (%s, %s)", (task.request.id, annotation_id))
        try:  # noqa: SIM105 - the idiom under test, as users write it
            conn.execute("INSERT INTO seen VALUES (%s)", (annotation_id,))
        except psycopg.errors.UniqueViolation:
            pass
        ran.append(str(task.request.id))
        return "indexed"

    return index


@pytest.mark.parametrize("source", ["borrowed autocommit", "context manager"])
def test_a_body_that_swallows_a_database_error_fails_instead_of_losing_the_job(
    db_url: str, worker_conn: psycopg.Connection[Any], source: str
) -> None:
    """Before: the task returned "indexed", COMMIT became ROLLBACK, and neither
    its effect nor its claim existed: a job acked as done that never happened."""
    worker_conn.execute("CREATE TABLE seen (annotation_id int PRIMARY KEY)")
    worker_conn.execute("INSERT INTO seen VALUES (5)")

    @contextlib.contextmanager
    def pooled() -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(db_url) as conn:
            yield conn

    connect: Any = (lambda: worker_conn) if source == "borrowed autocommit" else pooled
    ran: list[str] = []
    index = _swallowing(connect, ran)
    task_id = uuid.uuid4()
    with pytest.raises(AbortedTransactionError, match=r"t\.index\[.*\] returned, but a database"):
        index(fake_task(task_id), 5)
    assert ran == [str(task_id)]  # the body did return
    assert processed(db_url) == set()
    assert effects(db_url) == []
    assert worker_conn.info.transaction_status.name == "IDLE"
    assert index(fake_task(uuid.uuid4()), 6) == "indexed"  # no error: commits as before
    worker_conn.execute("DELETE FROM seen")
    assert index(fake_task(task_id), 5) == "indexed"  # the retry of the failed job runs
    assert sorted(e[1] for e in effects(db_url)) == [5, 6]
    assert task_id in processed(db_url)


def test_an_error_caught_around_a_savepoint_commits(
    db_url: str, worker_conn: psycopg.Connection[Any]
) -> None:
    worker_conn.execute("CREATE TABLE seen (annotation_id int PRIMARY KEY)")
    worker_conn.execute("INSERT INTO seen VALUES (5)")

    @effectively_once(lambda: worker_conn)
    def index(task: Any, conn: psycopg.Connection[Any], annotation_id: int) -> str:
        conn.execute("INSERT INTO effects VALUES (%s, %s)", (task.request.id, annotation_id))
        with contextlib.suppress(psycopg.errors.UniqueViolation), conn.transaction():
            conn.execute("INSERT INTO seen VALUES (%s)", (annotation_id,))
        return "indexed"

    task_id = uuid.uuid4()
    assert index(fake_task(task_id), 5) == "indexed"
    assert effects(db_url) == [(task_id, 5)]
    assert processed(db_url) == {task_id}


def test_an_on_skip_that_swallows_a_database_error_fails(
    db_url: str, worker_conn: psycopg.Connection[Any]
) -> None:
    def on_skip(task: Any, conn: psycopg.Connection[Any]) -> None:
        with contextlib.suppress(psycopg.errors.UndefinedTable):
            conn.execute("INSERT INTO skips_not_created VALUES (1)")

    body = effectively_once(lambda: worker_conn, on_skip=on_skip)(lambda task, conn: "ran")
    task_id = uuid.uuid4()
    assert body(fake_task(task_id)) == "ran"
    with pytest.raises(AbortedTransactionError, match=r"t\.index\[.*\]: on_skip returned"):
        body(fake_task(task_id))
    assert processed(db_url) == {task_id}
    assert worker_conn.info.transaction_status.name == "IDLE"
