"""The keyset fetch (drain.postgres.keyset) against a real Postgres: late commits and dead rows.

Ids are allocated at INSERT and committed whenever the application commits, so
a row can appear below ids the drain has already published. These tests hold
such transactions open on purpose while a real drain runs many cycles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

import drain
from drain.postgres import keyset, sql
from drain.postgres.store import fetch_params
from tests import support
from tests.integration.conftest import Running


def _stage_one_by_one(db_url: str, queue: str, n: int, tag: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        for i in range(n):
            with conn.transaction():
                drain.stage(conn, "t.keyset", [i], queue=queue, tag=tag)


def _mark(running: Running, priority: int = 0) -> tuple[int, int]:
    return running.drain.marks.marks().get(priority, keyset.START)


def _xact(conn: psycopg.Connection[Any]) -> int:
    """The id of ``conn``'s transaction (assigned now if it had none)."""
    row = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
    assert row is not None
    return int(row[0])


def test_a_row_committed_late_below_published_ids_is_still_published(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    running = start_active_drain(db_url, rescan_interval=0.0)
    # The early transaction takes an id, and stays open.
    with psycopg.connect(db_url) as early:
        late_task = drain.stage(early, "t.late", [0], queue=queue)
        row = early.execute("SELECT id FROM staged_jobs WHERE task_id = %s", [late_task]).fetchone()
        assert row is not None
        late = (_xact(early), row[0])
        # Later ids are staged, committed and published while it stays open,
        # over many cycles and looks at the heads.
        for round_ in range(4):
            _stage_one_by_one(db_url, queue, 25, tag=f"r{round_}")
            support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the later rows")
            published = 25 * (round_ + 1)
            support.wait_for(lambda: support.queue_depth(queue) >= published,  # noqa: B023
                             10, "their messages")
        assert _mark(running) <= late, "the mark passed a row not yet committed"
        early.commit()
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the late row")
    ids = support.task_ids(support.drain_queue(queue))
    assert str(late_task) in ids
    assert len(ids) == 101
    # And the marks are really in use: with the early transaction gone they move
    # past every row published so far.
    _stage_one_by_one(db_url, queue, 5, tag="after")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the last rows")
    support.wait_for(lambda: _mark(running) > late, 30, "the mark to pass the late row")
    assert running.drain.marks.rescans == 0


def test_under_a_held_snapshot_the_fetch_steps_over_no_dead_rows(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    with support.held_snapshot(db_url):
        running = start_active_drain(db_url, batch_size=500, rescan_interval=0.0)
        support.stage_backlog(db_url, queue, 20_000)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 120, "the backlog")
        with psycopg.connect(db_url) as conn:
            after = _xact(conn)  # a transaction id newer than the backlog's
        _stage_one_by_one(db_url, queue, 3, tag="wake")
        support.wait_for(lambda: _mark(running) > (after, keyset.ID_MIN), 30,
                         "the mark to pass the backlog")
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("SET enable_seqscan = off")
            conn.execute("SET enable_bitmapscan = off")
            fetch = sql.query("fetch_batch")
            marked = support.explain_buffers(
                conn, fetch, fetch_params(500, plan=running.drain.marks.current()))
            head = support.explain_buffers(conn, fetch, fetch_params(500, plan=keyset.FROM_HEAD))
    # 20,000 dead entries fill well over a hundred index and heap pages.
    assert head > 100, f"the head-of-index fetch read only {head} buffers"
    # The marked fetch: a descent per marked priority, per open range, and two for
    # delayed rows (from their mark, and the recent ones below it).
    assert marked < 30, f"the keyset fetch read {marked} buffers (head: {head})"
