"""A batch that rolls back must not leave the low-water marks past rows it removed
(drain.postgres.keyset, "Only what committed moves a mark"; issue 24, item 4).

A batch moves expired rows to dead_jobs, then looks at the heads in the same
transaction, which no longer sees them. If that transaction rolls back, the
rows are staged again; marks moved by the look would lie past them, and with
the periodic rescan off nothing would ever read them again. Both tests run the
drain with ``rescan_interval=0`` and a look in every batch, and roll back the
batch that expired the rows: by a concurrent UPDATE of a row of that batch (a
serialization failure on its DELETE), and by a COMMIT that fails.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import psycopg
import pytest

import drain
from drain.daemon import pipeline
from tests import support
from tests.integration.conftest import Running

#: Expiring rows per test.
EXPIRING = 3
#: Seconds from staging to the moment the rows expire (and the bait falls due).
AHEAD = 1.5
#: Seconds to wait for the expired rows to reach dead_jobs (the drain takes milliseconds).
SETTLE = 20.0


@pytest.fixture(autouse=True)
def look_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Look at the heads, and for expired rows, in every batch: the batch that
    expires the rows is then sure to look too."""
    monkeypatch.setattr(pipeline, "HEADS_INTERVAL", 0.0)
    monkeypatch.setattr(pipeline, "EXPIRE_INTERVAL", 0.0)


def _stage(db_url: str, queue: str, *, with_bait: bool) -> tuple[list[str], str | None]:
    """Stage EXPIRING delayed rows that expire AHEAD seconds from now (before they are
    due: they can only expire) and, with ``with_bait``, a row due at that same moment. One
    transaction, one now(): the first batch at or after it both expires the rows and
    fetches the bait. Returns the expiring rows' task ids and the bait's."""
    with psycopg.connect(db_url) as conn:
        expiring = [str(drain.stage(conn, "t.expiring", [i], queue=queue, countdown=3600))
                    for i in range(EXPIRING)]
        conn.execute("UPDATE staged_jobs SET expires_at = now() + make_interval(secs => %s)",
                     [AHEAD])
        bait = None
        if with_bait:
            bait = str(drain.stage(conn, "t.bait", ["before"], queue=queue, countdown=3600))
            conn.execute("UPDATE staged_jobs SET not_before = now() + make_interval(secs => %s) "
                         "WHERE task_id = %s", [AHEAD, bait])
    return expiring, bait


def _expired(db_url: str) -> list[str]:
    with psycopg.connect(db_url) as conn:
        return [str(r[0]) for r in conn.execute(
            "SELECT task_id FROM dead_jobs WHERE reason = 'expired' ORDER BY task_id")]


def _wait_until_expired(db_url: str, expiring: list[str], running: Running) -> None:
    try:
        support.wait_for(lambda: support.staged_count(db_url) == 0, SETTLE,
                         "the expired rows to leave staged_jobs")
    except AssertionError:
        with psycopg.connect(db_url) as conn:
            left = conn.execute("SELECT task_id, expires_at, xact FROM staged_jobs").fetchall()
        raise AssertionError(
            f"rows stranded below the marks after the batch rolled back: {left}; marks: "
            f"{running.drain.marks.current()}") from None
    assert _expired(db_url) == sorted(expiring)


def test_expired_rows_of_a_batch_rolled_back_by_a_conflicting_update_are_not_stranded(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    fetched, go_on = threading.Event(), threading.Event()

    def hold_the_bait(_elapsed: float, rows: int) -> None:
        if rows and not fetched.is_set():  # the batch that expired the rows
            fetched.set()
            go_on.wait(30)

    running = start_active_drain(db_url, rescan_interval=0.0, on_fetch=hold_the_bait)
    expiring, bait = _stage(db_url, queue, with_bait=True)
    support.wait_for(fetched.is_set, 30, "the drain to fetch the bait")
    with psycopg.connect(db_url) as conn:  # while the batch holds it: its DELETE will conflict
        conn.execute("""UPDATE staged_jobs SET args = '["after"]' WHERE task_id = %s""", [bait])
    go_on.set()
    _wait_until_expired(db_url, expiring, running)
    bodies = [json.loads(body)[0] for _, _, body in support.drain_queue(queue)]
    assert bodies[-1] == ["after"], bodies
    assert running.drain.marks.rescans == 0


def test_expired_rows_of_a_batch_whose_commit_fails_are_not_stranded(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    with psycopg.connect(db_url) as conn:  # the first COMMIT that deletes a row fails
        conn.execute("CREATE SEQUENCE test_commits")
        conn.execute("""
            CREATE FUNCTION test_fail_first_commit() RETURNS trigger LANGUAGE plpgsql
            SECURITY DEFINER AS $$  -- the drain's role need not see the sequence
            BEGIN
                IF nextval('test_commits') = 1 THEN
                    RAISE EXCEPTION 'test: this commit fails'
                        USING ERRCODE = 'serialization_failure';
                END IF;
                RETURN NULL;
            END $$""")
        conn.execute("""
            CREATE CONSTRAINT TRIGGER test_fail_first_commit AFTER DELETE ON staged_jobs
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
            EXECUTE FUNCTION test_fail_first_commit()""")
    running = start_active_drain(db_url, rescan_interval=0.0)
    expiring, _ = _stage(db_url, queue, with_bait=False)
    _wait_until_expired(db_url, expiring, running)
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT last_value FROM test_commits").fetchone()
    assert row is not None and row[0] > EXPIRING, "the failed commit never happened"
    assert running.drain.marks.rescans == 0
