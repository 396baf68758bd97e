"""A locked row is not a changed row (drain.postgres.conflicts; issue 36, item 1).

Another connection holds staged rows with ``SELECT ... FOR UPDATE``, or the
whole table in SHARE mode (as a plain ``CREATE INDEX`` does), while the drain
publishes them. Before, the drain took each lock timeout for a change: it
halved the batch with a 50 ms wait per statement (2n-1 statements on the loop
thread), republished every locked row, logged them as changed, and a long
lock stalled the loop past the broker's heartbeat and /healthz. Now a locked
row's message is delivered once, its delete is pending until the lock ends,
and the rest of the drain flows meanwhile. Deliveries are counted by a real
consumer; nothing here depends on how fast the machine is, only on counts.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import drain
from drain.daemon import watchdog
from drain.daemon.runner import State
from tests import support
from tests.deliveries import Deliveries
from tests.integration.conftest import Running

#: Rows held locked, and rows of an unrelated queue staged while they are.
LOCKED = 300
UNRELATED = 20


@contextlib.contextmanager
def holding(db_url: str, statement: str, *params: Any) -> Iterator[psycopg.Connection[Any]]:
    """Another session's transaction that ran ``statement`` and stays open (its locks
    held) until the block ends, then rolls back."""
    conn = psycopg.connect(db_url)
    try:
        conn.execute(statement, params or None)
        yield conn
    finally:
        conn.rollback()
        conn.close()


def _metric(running: Running, name: str, **labels: str) -> float:
    value = running.drain.metrics.registry.get_sample_value(name, labels or None)
    return float(value or 0.0)


def _cycles(running: Running) -> float:
    return _metric(running, "drain_cycle_seconds_count")


def _more_cycles(running: Running, count: int) -> None:
    """Wait until the drain went round ``count`` more cycles."""
    start = _cycles(running)
    support.wait_for(lambda: _cycles(running) >= start + count, 60,
                     f"{count} more turns of the loop (it stands still while rows are locked?)")


def _stage(db_url: str, task: str, markers: list[str], queue: str) -> None:
    with psycopg.connect(db_url) as conn:
        drain.stage_many(conn, [drain.Job(task, [m], queue=queue) for m in markers])


def _once_each(deliveries: Deliveries, markers: list[str]) -> dict[str, int]:
    """The markers delivered other than exactly once, with their counts."""
    return {m: n for m in markers if (n := deliveries.count(m)) != 1}


def test_rows_locked_for_update_are_delivered_once_and_the_rest_flows(
    db_url: str, queue: str, other_queue: str, start_active_drain: Callable[..., Running],
) -> None:
    locked = [f"k{i}" for i in range(LOCKED)]
    unrelated = [f"u{i}" for i in range(UNRELATED)]
    _stage(db_url, "t.locked", locked, queue)
    with Deliveries([queue, other_queue]).running() as deliveries, holding(
            db_url, "SELECT id FROM staged_jobs WHERE queue = %s FOR UPDATE", queue):
        running = start_active_drain(db_url)
        support.wait_for(lambda: all(deliveries.count(m) for m in locked), 60,
                         "the locked rows' messages")
        # An unrelated queue's rows, staged while the lock is held: delivered and
        # deleted while it still is.
        _stage(db_url, "t.unrelated", unrelated, other_queue)
        support.wait_for(lambda: all(deliveries.count(m) for m in unrelated), 60,
                         "the unrelated rows' messages while the rows are locked")
        support.wait_for(lambda: support.staged_count(db_url) == LOCKED, 60,
                         "the unrelated rows' deletes while the rows are locked")
        _more_cycles(running, 10)  # still locked: later cycles publish nothing again
        assert _once_each(deliveries, locked + unrelated) == {}
        assert support.staged_count(db_url) == LOCKED, "a locked row was deleted"
        assert _metric(running, "drain_delete_pending_rows") == LOCKED
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                     "the locked rows' deletes once the lock ended")
    _more_cycles(running, 3)
    assert deliveries.error is None, deliveries.error
    assert _once_each(deliveries, locked + unrelated) == {}
    assert _metric(running, "drain_conflicted_rows_total") == 0, "locked rows counted as changed"
    assert _metric(running, "drain_unsettled_rows_total") == 0
    assert _metric(running, "drain_delete_pending_rows") == 0
    assert _metric(running, "drain_deleted_total") == LOCKED + UNRELATED


def test_a_share_lock_on_the_table_changes_no_row(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """LOCK TABLE ... IN SHARE MODE (a plain CREATE INDEX) blocks every DELETE:
    all of the batch's deletes are pending, none of its rows changed."""
    markers = [f"s{i}" for i in range(LOCKED)]
    _stage(db_url, "t.shared", markers, queue)
    with Deliveries([queue]).running() as deliveries, holding(
            db_url, "LOCK TABLE staged_jobs IN SHARE MODE"):
        running = start_active_drain(db_url)
        support.wait_for(lambda: all(deliveries.count(m) for m in markers), 60,
                         "the rows' messages under the table lock")
        _more_cycles(running, 10)
        assert _once_each(deliveries, markers) == {}
        assert support.staged_count(db_url) == LOCKED
        assert _metric(running, "drain_delete_pending_rows") == LOCKED
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                     "the deletes once the table lock ended")
    _more_cycles(running, 3)
    assert deliveries.error is None, deliveries.error
    assert _once_each(deliveries, markers) == {}
    assert _metric(running, "drain_conflicted_rows_total") == 0, "locked rows counted as changed"
    assert "changed under the drain" not in caplog.text


def test_expired_rows_locked_move_to_dead_jobs_once_the_lock_ends(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
) -> None:
    """The move to dead_jobs (here of expired rows) meets a lock the same way: pending,
    not changed, and done once the lock ends."""
    expired = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)
    with psycopg.connect(db_url) as conn:
        drain.stage_many(conn, [drain.Job("t.expired", [f"e{i}"], queue=queue, expires=expired)
                                for i in range(50)])
    with holding(db_url, "SELECT id FROM staged_jobs WHERE queue = %s FOR UPDATE", queue):
        running = start_active_drain(db_url)
        _more_cycles(running, 5)
        assert _metric(running, "drain_conflicted_rows_total") == 0, (
            "locked rows counted as changed")
        assert support.staged_count(db_url) == 50
        assert _metric(running, "drain_delete_pending_rows") == 50
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the expired rows' move")
    with psycopg.connect(db_url) as conn:
        reasons = conn.execute("SELECT reason, count(*) FROM dead_jobs GROUP BY reason").fetchall()
    assert reasons == [("expired", 50)]
    assert _metric(running, "drain_expired_total") == 50
    assert _metric(running, "drain_conflicted_rows_total") == 0
    assert _metric(running, "drain_delete_pending_rows") == 0
    assert support.queue_depth(queue) == 0


def test_a_long_lock_keeps_the_broker_connection_and_the_loop_alive(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
) -> None:
    """A lock held for many broker heartbeats (1 s here) and past what /healthz
    allows a turn of the loop: the connection is kept, /healthz stays alive."""
    markers = [f"h{i}" for i in range(LOCKED)]
    _stage(db_url, "t.held", markers, queue)
    with Deliveries([queue]).running() as deliveries, holding(
            db_url, "SELECT id FROM staged_jobs WHERE queue = %s FOR UPDATE", queue):
        running = start_active_drain(db_url, broker_heartbeat=1, confirm_timeout=1.0,
                                     db_timeout=1.0)
        stuck_after = watchdog.stuck_after(running.drain.settings)
        support.wait_for(lambda: deliveries.count(markers[0]), 60, "the first message")
        # The lock's duration is the scenario: several heartbeat timeouts, and
        # longer than /healthz lets the loop stand still.
        held_until = time.monotonic() + stuck_after + 2.0
        dead: list[dict[str, object]] = []
        states: set[State] = set()
        while time.monotonic() < held_until:
            health = running.drain.health()
            if not health["alive"]:
                dead.append(health)
            states.add(running.drain.state)
            time.sleep(0.1)
        support.wait_for(lambda: all(deliveries.count(m) for m in markers), 60,
                         "the locked rows' messages")
        pending = _metric(running, "drain_delete_pending_rows")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                     "the deletes once the lock ended")
    assert deliveries.error is None, deliveries.error
    assert dead == [], f"/healthz failed {len(dead)} times while the rows were locked"
    assert states == {State.ACTIVE}, states
    assert _metric(running, "drain_reconnects_total", target="broker") == 0, (
        "the broker connection was lost while the rows were locked")
    assert _once_each(deliveries, markers) == {}
    assert pending == LOCKED
    assert _metric(running, "drain_conflicted_rows_total") == 0


def test_the_broker_connection_is_served_while_a_statement_waits(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
) -> None:
    """A statement that waits for a lock (here the fetch, behind an ACCESS EXCLUSIVE
    lock, up to the session's lock timeout) does not starve the broker
    connection: its heartbeats (1 s) go on."""
    running = start_active_drain(db_url, broker_heartbeat=1, db_timeout=8.0)
    with holding(db_url, "LOCK TABLE staged_jobs IN ACCESS EXCLUSIVE MODE"):
        support.wait_for(lambda: running.drain._store.waiting, 30, "a statement to wait")
        # The lock's duration is the scenario: several heartbeat timeouts.
        held_until = time.monotonic() + 6.0
        while time.monotonic() < held_until:
            assert running.drain.state is State.ACTIVE
            time.sleep(0.1)
    with Deliveries([queue]).running() as deliveries:
        _stage(db_url, "t.after", ["after"], queue)
        support.wait_for(lambda: deliveries.count("after"), 60, "a job staged after the lock")
    assert _metric(running, "drain_reconnects_total", target="broker") == 0, (
        "the broker connection was lost while a statement waited")
    assert deliveries.count("after") == 1
