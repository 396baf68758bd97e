"""Inputs the schema accepts that an id-based low-water mark got wrong (issue 11).

Each of these made a row wait for the periodic rescan (or, for a negative id
with lanes, never reach the broker). The drains here run with the rescan
turned off (``rescan_interval=0``): a row the marks pass is never published,
and the test's deadline catches it. The deadlines are generous on purpose;
they bound a wait that must end, they do not measure speed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import drain
from drain.postgres.keyset import ID_MIN, START
from tests import support
from tests.integration.conftest import Running

#: Seconds a row may take to arrive here: far more than the drain needs, far
#: less than forever (with the rescan off, a passed row never arrives).
DEADLINE = 20.0


def _drained(db_url: str, queue: str, markers: list[Any]) -> None:
    """Wait until every marker has arrived in ``queue`` (in any order, at least once)."""
    seen: set[str] = set()

    def arrived() -> bool:
        for _, _, body in support.drain_queue(queue, timeout=0.2):
            seen.add(json.dumps(json.loads(body)[0]))
        return {json.dumps([m]) for m in markers} <= seen

    support.wait_for(arrived, DEADLINE, f"{markers} to be published")


def _stage(db_url: str, queue: str, markers: list[Any], **options: Any) -> None:
    with psycopg.connect(db_url) as conn:
        for marker in markers:
            drain.stage(conn, "t.input", [marker], queue=queue, **options)


def _sql(db_url: str, statement: str, *params: Any) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(statement, params)


def _newer_xact(db_url: str) -> tuple[int, int]:
    """A transaction id newer than every row committed so far, and the last id."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT pg_current_xact_id()::text::bigint, "
                           "(SELECT last_value FROM staged_jobs_id_seq)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _marks_pass(running: Running, priority: int, newer: tuple[int, int]) -> None:
    """Wait until ``priority``'s mark has passed every row committed before ``newer``."""
    support.wait_for(
        lambda: running.drain.marks.marks().get(priority, START) >= (newer[0], ID_MIN),
        DEADLINE, f"priority {priority}'s mark to pass the rows published")


def _idle_cycles(running: Running, n: int = 15) -> None:
    """Wait until the drain went round ``n`` more times (with nothing to publish,
    each cycle is a fetch and, now and then, a look at the heads)."""
    registry = running.drain.metrics.registry

    def cycles() -> float:
        return registry.get_sample_value("drain_cycle_seconds_count") or 0.0

    start = cycles()
    support.wait_for(lambda: cycles() >= start + n, DEADLINE, f"{n} cycles of the drain")


def _warm(db_url: str, queue: str, running: Running, n: int = 20) -> None:
    """Publish some rows first, and wait until the marks have moved past them."""
    _stage(db_url, queue, [f"warm{i}" for i in range(n)])
    _drained(db_url, queue, [f"warm{i}" for i in range(n)])
    newer = _newer_xact(db_url)
    _stage(db_url, queue, ["wake"])  # a look at the heads in a later snapshot
    _drained(db_url, queue, ["wake"])
    _marks_pass(running, 0, newer)


@pytest.fixture
def keyset_drain(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> Running:
    running = start_active_drain(db_url, rescan_interval=0.0)
    _warm(db_url, queue, running)
    return running


def test_a_huge_explicit_id_does_not_poison_the_priority(
    db_url: str, queue: str, keyset_drain: Running
) -> None:
    _sql(db_url, "INSERT INTO staged_jobs (id, task_name, args, queue) OVERRIDING SYSTEM VALUE "
         "VALUES (1000000000, 't.big', '[\"big\"]', %s)", queue)
    _drained(db_url, queue, ["big"])
    newer = _newer_xact(db_url)
    _stage(db_url, queue, ["wake"])
    _drained(db_url, queue, ["wake"])
    _marks_pass(keyset_drain, 0, newer)
    for round_ in range(3):
        _idle_cycles(keyset_drain)  # an empty backlog for a while: nothing to keep a mark low
        _stage(db_url, queue, [f"after{round_}"])
        _drained(db_url, queue, [f"after{round_}"])
    assert keyset_drain.drain.marks.rescans == 0


def test_rows_after_truncate_restart_identity_are_published(
    db_url: str, queue: str, keyset_drain: Running
) -> None:
    _sql(db_url, "TRUNCATE staged_jobs RESTART IDENTITY")
    _stage(db_url, queue, ["restarted1", "restarted2"])
    _drained(db_url, queue, ["restarted1", "restarted2"])


def test_a_sequence_reset_below_the_published_ids_is_harmless(
    db_url: str, queue: str, keyset_drain: Running
) -> None:
    _sql(db_url, "ALTER TABLE staged_jobs ALTER COLUMN id RESTART WITH 1")
    _stage(db_url, queue, ["reset"])
    _drained(db_url, queue, ["reset"])


def test_a_low_id_cached_by_another_session_is_published(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    _sql(db_url, "ALTER TABLE staged_jobs ALTER COLUMN id SET CACHE 50")
    running = start_active_drain(db_url, rescan_interval=0.0)
    with psycopg.connect(db_url, autocommit=True) as early, \
            psycopg.connect(db_url, autocommit=True) as late:
        # early caches ids 1..50, late 51..100; late's rows are published first.
        drain.stage(early, "t.input", ["early1"], queue=queue)
        _drained(db_url, queue, ["early1"])
        for i in range(10):
            drain.stage(late, "t.input", [f"late{i}"], queue=queue)
        _drained(db_url, queue, [f"late{i}" for i in range(10)])
        newer = _newer_xact(db_url)
        drain.stage(late, "t.input", ["wake"], queue=queue)
        _drained(db_url, queue, ["wake"])
        _marks_pass(running, 0, newer)
        drain.stage(early, "t.input", ["early2"], queue=queue)  # id 2
        _drained(db_url, queue, ["early2"])


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_negative_id_is_published(
    db_url: str, queue: str, start_active_drain: Callable[..., Running], lanes: int
) -> None:
    for lane in range(lanes):
        start_active_drain(db_url, rescan_interval=0.0, lanes=lanes, lane=lane)
    for row_id in (-7, -8):
        _sql(db_url, "INSERT INTO staged_jobs (id, task_name, args, queue) "
             "OVERRIDING SYSTEM VALUE VALUES (%s, 't.negative', %s, %s)",
             row_id, json.dumps([row_id]), queue)
    _drained(db_url, queue, [-7, -8])


def test_a_delayed_row_updated_to_ready_is_published(
    db_url: str, queue: str, keyset_drain: Running
) -> None:
    _stage(db_url, queue, ["delayed"], countdown=3600)
    _warm(db_url, queue, keyset_drain)  # the marks move past the delayed row's id
    _sql(db_url, "UPDATE staged_jobs SET not_before = NULL WHERE args = '[\"delayed\"]'")
    _drained(db_url, queue, ["delayed"])


def test_a_row_moved_to_a_priority_that_has_a_mark_is_published(
    db_url: str, queue: str, keyset_drain: Running
) -> None:
    _stage(db_url, queue, ["moved"], countdown=3600, priority=5)
    _warm(db_url, queue, keyset_drain)  # priority 0's mark passes the moved row's id
    _sql(db_url, "UPDATE staged_jobs SET not_before = NULL, priority = 0 "
         "WHERE args = '[\"moved\"]'")
    _drained(db_url, queue, ["moved"])


def test_an_explicit_xact_is_replaced_by_the_real_one(db_url: str, queue: str) -> None:
    """xact is the staging transaction's id whatever an INSERT or UPDATE says."""
    with psycopg.connect(db_url) as conn:
        conn.execute("INSERT INTO staged_jobs (task_name, queue, xact) VALUES ('t.x', %s, '3')",
                     [queue])
        row = conn.execute("SELECT xact = pg_current_xact_id() FROM staged_jobs").fetchone()
        assert row == (True,)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE staged_jobs SET priority = 1")
        row = conn.execute("SELECT xact = pg_current_xact_id() FROM staged_jobs").fetchone()
        assert row == (True,)


def test_a_writer_open_behind_a_stuck_head_on_a_quiet_server(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    """The head of the queue is stuck (a queue the broker refuses), nothing else
    commits, and one writer stays open with a row: its xid is at or above every
    snapshot's xmax, so no snapshot lists it as running. The mark must still
    not pass its row."""
    refused = support.unique("drain_test_refused")
    with support.broker_channel() as ch:
        ch.queue_declare(refused, durable=True, arguments={"x-max-priority": 3})
    try:
        running = start_active_drain(db_url, rescan_interval=0.0)
        _warm(db_url, queue, running)
        with psycopg.connect(db_url) as writer, psycopg.connect(db_url) as other:
            # `other` has a transaction id before the writer has one; the writer
            # then stages a row (id N) and stays open; `other` stages a row
            # (id N + 1) to the refused queue, the head of the backlog from now
            # on, and commits. No transaction ends after that: the writer's id
            # is at or above every later snapshot's xmax, in no list of running
            # transactions, while the head is past its row's id.
            other.execute("SELECT pg_current_xact_id()")
            drain.stage(writer, "t.input", ["open"], queue=queue)
            drain.stage(other, "t.input", ["stuck"], queue=refused)
            other.commit()
            _idle_cycles(running, 20)  # looks at the heads while the writer is open
            writer.commit()
        seen: list[Any] = []

        def arrived() -> bool:
            seen.extend(json.loads(b)[0] for _, _, b in support.drain_queue(queue, timeout=0.2))
            return ["open"] in seen

        support.wait_for(arrived, DEADLINE, "the open writer's row")
        assert support.staged_count(db_url) == 1, "the refused queue's row stays staged"
    finally:
        support.delete_queue(refused)
