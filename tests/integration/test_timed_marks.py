"""The delayed and expiring marks (drain.postgres.keyset, "Delayed and expiring rows")
against a real Postgres: dead entries skipped, late rows still found."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import psycopg

import drain
from drain.postgres import keyset, sql
from drain.postgres.store import fetch_params
from tests import support
from tests.integration.conftest import Running


def _timestamp(conn: psycopg.Connection[Any], text: str) -> dt.datetime:
    row = conn.execute("SELECT %s::timestamptz", [text]).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _delayed_from(running: Running) -> str:
    return running.drain.marks.current().delayed_from


def _expiring_from(running: Running) -> str:
    return running.drain.marks.current().expiring_from


def _past_mark(db_url: str, mark: str, moment: dt.datetime) -> bool:
    if mark == "infinity":
        return True
    if mark == "-infinity":
        return False
    with psycopg.connect(db_url) as conn:
        return _timestamp(conn, mark) > moment


def _stage_late(db_url: str, queue: str, running: Running, column: str,
                mark: Callable[[Running], str], *, countdown: float | None = None,
                expires: float | None = None) -> str:
    """Stage a row whose ``column`` is an hour in the past in a transaction held open
    while other rows (staged with ``countdown`` and ``expires``) are published and
    the mark for ``column`` moves past it; then commit it. Returns its task id."""
    with psycopg.connect(db_url) as late:
        task = drain.stage(late, "t.late", queue=queue, countdown=3600, expires=3600)
        late.execute(f"UPDATE staged_jobs SET {column} = now() - interval '1 hour' "
                     "WHERE task_id = %s", [task])
        row = late.execute(f"SELECT {column} FROM staged_jobs WHERE task_id = %s",
                           [task]).fetchone()
        assert row is not None
        n = 0
        while not _past_mark(db_url, mark(running), row[0]):
            with psycopg.connect(db_url) as conn:
                drain.stage(conn, "t.other", [n], queue=queue, countdown=countdown,
                            expires=expires)
            n += 1
            support.wait_for(lambda: support.staged_count(db_url) == 0, 30,
                             "the other row to be published")
            assert n < 200, f"the {column} mark never moved"
        late.commit()
    return str(task)


def test_a_delayed_row_committed_late_below_the_mark_is_published(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    running = start_active_drain(db_url, rescan_interval=0.0)
    late = _stage_late(db_url, queue, running, "not_before", _delayed_from, countdown=0.01)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the late row")
    assert late in support.task_ids(support.drain_queue(queue))
    assert running.drain.marks.rescans == 0


def test_an_expired_row_committed_late_below_the_mark_is_dead_lettered(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    running = start_active_drain(db_url, rescan_interval=0.0)
    late = _stage_late(db_url, queue, running, "expires_at", _expiring_from, expires=600)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the late row")
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT reason FROM dead_jobs WHERE task_id = %s",
                           [late]).fetchone()
    assert row == ("expired",)
    assert late not in support.task_ids(support.drain_queue(queue))


def _now_after(db_url: str, moment: dt.datetime) -> bool:
    with psycopg.connect(db_url) as conn:
        return _timestamp(conn, "now") > moment


def test_under_a_held_snapshot_delayed_and_expiring_reads_step_over_no_dead_rows(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    with support.held_snapshot(db_url):
        running = start_active_drain(db_url, batch_size=500, rescan_interval=0.0)
        with psycopg.connect(db_url) as conn:  # due at once, expiring in 2 s
            drain.stage_many(conn, [drain.Job("t.timed", [i], queue=queue, countdown=0.001,
                                              expires=2.0) for i in range(10_000)])
            row = conn.execute("SELECT max(expires_at), max(xact)::text::bigint "
                               "FROM staged_jobs").fetchone()
            assert row is not None
            last_expiry, backlog_xact = row
        support.wait_for(lambda: support.staged_count(db_url) == 0, 120, "the backlog")
        # Their expiries pass (dead entries now below now()); later rows move the
        # marks past them.
        support.wait_for(lambda: _now_after(db_url, last_expiry), 30, "the expiries to pass")
        with psycopg.connect(db_url) as conn:
            drain.stage(conn, "t.wake", queue=queue, countdown=0.001, expires=3600)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the last row")
        # Below the marks the reads still take the rows of transactions at or above
        # the last look's xmin (timed_xact): the backlog's dead entries too, until a
        # look's snapshot has an xmin past the backlog's transaction. Transaction ids
        # are server-wide, so a write transaction open in another database of the
        # cluster (another test's, under xdist) holds that xmin back until it ends.
        def _past_backlog() -> keyset.FetchPlan | None:
            plan = running.drain.marks.current()
            past = (plan.timed_xact > backlog_xact
                    and _past_mark(db_url, plan.delayed_from, last_expiry)
                    and _past_mark(db_url, plan.expiring_from, last_expiry))
            return plan if past else None

        plan: keyset.FetchPlan = support.wait_for(
            _past_backlog, 60, "the marks (and the looks' xmin) to pass the backlog")
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("SET enable_seqscan = off")
            conn.execute("SET enable_bitmapscan = off")
            fetch, expire = sql.query("fetch_batch"), sql.query("expiring")
            marked = support.explain_buffers(conn, fetch, fetch_params(500, plan=plan))
            head = support.explain_buffers(conn, fetch, fetch_params(500, plan=keyset.FROM_HEAD))
            params = {"exclude": [], "limit": 500, "lanes": 1, "lane": 0,
                      "timed_xact": plan.timed_xact}
            with conn.transaction(force_rollback=True):
                marked_expire = support.explain_buffers(
                    conn, expire, {**params, "expiring_from": plan.expiring_from})
            with conn.transaction(force_rollback=True):
                head_expire = support.explain_buffers(
                    conn, expire, {**params, "expiring_from": "-infinity"})
    print(f"\n[timed marks] fetch buffers: marked {marked}, from the head {head}; "
          f"expire buffers: marked {marked_expire}, from the head {head_expire}")
    # 10,000 dead entries fill dozens of index and heap pages.
    assert head > 100 and head_expire > 50, (head, head_expire)
    assert marked < 40, f"the marked fetch read {marked} buffers (head: {head})"
    assert marked_expire < 20, f"the marked expire read {marked_expire} (head: {head_expire})"
