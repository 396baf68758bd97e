"""Issue 11's cases against the real Postgres and RabbitMQ: returns matched to
their own publish, dead letters whatever the ids, lanes that expire only
their own rows, and a paused leader that does not publish a stale batch.

The low-water marks' cases (ids the sequence does not promise, updates, an
open writer behind a stuck head) are in test_keyset_inputs.py.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import drain
from drain.broker.outgoing import PauseKey
from drain.broker.publisher import Publisher
from drain.celery import message
from drain.daemon import pipeline, runner
from drain.postgres.rows import StagedRow
from drain.settings.urls import broker_parameters
from tests import support
from tests.integration.conftest import Running


def _row(row_id: int, task_id: uuid.UUID, queue: str) -> StagedRow:
    return StagedRow(row_id, task_id, "t.invariant", f"[{row_id}]", "{}", queue)


# -- 1. a return belongs to one publish, not to a task id ---------------------------


def test_a_return_is_matched_to_its_own_publish_not_to_a_task_id(
    queue: str, other_queue: str
) -> None:
    """Row A (task id T) ends batch k and is routed; row B (same T) starts batch
    k+1 and goes to a queue deleted after the drain declared it. B's return
    arrives while batch k is being confirmed. It must not be taken for A's, and
    B's ack must not count as B's confirm (that deleted B's row: a lost job)."""
    shared = uuid.uuid4()
    builder = message.Builder(origin="gen1@test", reply_to=str(uuid.uuid4()))
    pub = Publisher(broker_parameters(support.BROKER_URL), display_url="broker")
    pub.connect()
    try:
        assert pub.declare({queue, other_queue}) == {}
        support.delete_queue(other_queue)
        first = [_row(i, uuid.uuid4(), queue) for i in range(1, 10)] + [_row(10, shared, queue)]
        second = [_row(11, shared, other_queue)] + [
            _row(i, uuid.uuid4(), queue) for i in range(12, 21)]
        batch_k = pub.start((builder.build(r) for r in first), queues={queue}, count=10)
        batch_k1 = pub.start((builder.build(r) for r in second),
                             queues={queue, other_queue}, count=10)
        result_k = pub.wait(batch_k)
        result_k1 = pub.wait(batch_k1)
    finally:
        pub.close()
    assert result_k.error is None and result_k1.error is None
    assert result_k.returned == [] and sorted(result_k.confirmed) == list(range(1, 11))
    assert result_k1.returned == [11]
    assert 11 not in result_k1.confirmed, "a returned message counted as confirmed"
    assert sorted(result_k1.confirmed) == list(range(12, 21))
    assert result_k1.returned_keys == {PauseKey(other_queue)}
    assert sorted(support.task_ids(support.drain_queue(queue))).count(str(shared)) == 1


def test_two_rows_with_one_task_id_are_two_deliveries(
    db_url: str, queue: str, start_drain: Callable[..., Running]
) -> None:
    """A task id shared by two rows (a job staged again under its id) is delivered
    once per row: both messages carry the id, so a consumer that dedupes by task
    id (drain.consumer) runs it once."""
    shared = uuid.uuid4()
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.same", [1], queue=queue, task_id=shared)
        drain.stage(conn, "t.same", [2], queue=queue, task_id=shared)
    start_drain(db_url, batch_size=1)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "both rows")
    messages = support.drain_queue(queue)
    assert support.task_ids(messages) == [str(shared), str(shared)]
    assert sorted(json.loads(body)[0] for _, _, body in messages) == [[1], [2]]


def test_returned_rows_with_a_shared_task_id_all_stay_staged_until_delivered(
    db_url: str, queue: str, other_queue: str, start_drain: Callable[..., Running],
) -> None:
    """The drain end to end, small batches, rows sharing task ids spread over a
    routed queue and one deleted behind the drain's back: nothing is deleted
    without its own confirm, and everything arrives once the queue is back."""
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True)
        ch.queue_declare(other_queue, durable=True)
    running = start_drain(db_url, batch_size=10, queue_declare="passive")
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.warm", [0], queue=other_queue)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the drain to declare")
    support.drain_queue(other_queue)
    support.delete_queue(other_queue)
    shared = [uuid.uuid4() for _ in range(5)]
    with psycopg.connect(db_url) as conn:
        for i in range(100):
            target = other_queue if i % 2 else queue
            drain.stage(conn, "t.mixed", [i], queue=target, task_id=shared[i % 5])
    support.wait_for(lambda: running.drain.metrics.registry.get_sample_value(
        "drain_unroutable_total") or 0, 30, "messages to come back unroutable")
    support.wait_for(lambda: support.staged_count(db_url) <= 50, 30, "the routed half")
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT args FROM staged_jobs ORDER BY id").fetchall()
    assert [args[0] % 2 for (args,) in left] == [1] * len(left), "a routed row is left"
    assert len(left) == 50, "a row of the deleted queue was deleted without a confirm"
    with support.broker_channel() as ch:
        ch.queue_declare(other_queue, durable=True)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the returned half")
    got = sorted(json.loads(body)[0][0] for _, _, body in support.drain_queue(other_queue))
    assert set(got) == set(range(1, 100, 2))


# -- 2. ids handed out again ------------------------------------------------------


def test_a_dead_letter_with_an_id_already_in_dead_jobs_does_not_wedge_the_drain(
    db_url: str, queue: str, start_drain: Callable[..., Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="drain")
    running = start_drain(db_url, max_message_size=2000)

    def stage_doomed(marker: str) -> None:
        with psycopg.connect(db_url) as conn:
            drain.stage(conn, "t.expired", [marker], queue=queue,
                        expires=dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1))
            drain.stage(conn, "t.too_large", ["x" * 5000, marker], queue=queue)

    stage_doomed("first")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the first dead letters")
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("TRUNCATE staged_jobs RESTART IDENTITY")
    stage_doomed("second")
    ids = [str(t) for t in _stage_many(db_url, queue, 5)]
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the second round")
    with psycopg.connect(db_url) as conn:
        dead = conn.execute("SELECT id, reason FROM dead_jobs ORDER BY dead_id").fetchall()
    assert sorted(dead) == sorted([(1, "expired"), (2, "too_large")] * 2)
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(ids)
    assert not [r for r in caplog.records if "duplicate key" in r.getMessage()]
    assert running.drain.state is runner.State.ACTIVE


def _stage_many(db_url: str, queue: str, n: int, **options: Any) -> list[uuid.UUID]:
    with psycopg.connect(db_url) as conn:
        return drain.stage_many(
            conn, [drain.Job("t.row", [i], queue=queue, **options) for i in range(n)])


# -- 4. lanes and expiry; a paused leader --------------------------------------------


def test_a_lane_expires_only_its_own_rows(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, queue, expires_at) "
            "SELECT 't.gone', %s, now() - interval '1 minute' FROM generate_series(1, 40)",
            [queue])
    running = start_active_drain(db_url, lanes=4, lane=1)
    support.wait_for(
        lambda: running.drain.metrics.registry.get_sample_value("drain_expired_total") == 10,
        30, "lane 1's ten expired rows")
    with psycopg.connect(db_url) as conn:
        dead = [r[0] for r in conn.execute("SELECT id FROM dead_jobs").fetchall()]
        staged = [r[0] for r in conn.execute("SELECT id FROM staged_jobs").fetchall()]
    assert sorted(dead) == [i for i in range(1, 41) if i % 4 == 1]
    assert len(staged) == 30 and all(i % 4 != 1 for i in staged)


def test_four_lanes_expiring_and_publishing_at_once_never_conflict(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="drain")
    lanes = [start_active_drain(db_url, lanes=4, lane=k, batch_size=20) for k in range(4)]
    with psycopg.connect(db_url) as conn:
        for _ in range(10):
            with conn.transaction():
                conn.execute(
                    "INSERT INTO staged_jobs (task_name, queue, args, expires_at) "
                    "SELECT 't.lanes', %s, jsonb_build_array(g), "
                    "  CASE WHEN g %% 3 = 0 THEN now() - interval '1 minute' END "
                    "FROM generate_series(1, 300) g", [queue])
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "every row")
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT count(*), count(DISTINCT id) FROM dead_jobs").fetchone()
    assert row == (1000, 1000)
    delivered = len(support.drain_queue(queue))
    assert delivered >= 2000
    expired = sum(r.drain.metrics.registry.get_sample_value("drain_expired_total") or 0
                  for r in lanes)
    assert expired == 1000
    trouble = [r.getMessage() for r in caplog.records
               if "lock released" in r.getMessage() or "serialize" in r.getMessage()]
    assert not trouble, trouble


def test_a_leader_paused_past_its_session_does_not_publish_its_stale_batch(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
) -> None:
    """A leader frozen between fetch and publish (SIGSTOP, a paused VM) while the
    server ends its session and a standby takes over: the batch it fetched is
    not published when it wakes; the standby delivers each row once."""
    frozen = threading.Event()
    thaw = threading.Event()

    def freeze_once(_elapsed: float, rows: int) -> None:
        if rows and not frozen.is_set():
            frozen.set()
            thaw.wait(60)

    leader = start_active_drain(db_url, on_fetch=freeze_once, batch_size=50)
    ids = [str(t) for t in _stage_many(db_url, queue, 20)]
    support.wait_for(frozen.is_set, 30, "the leader to fetch the batch")
    paused_at = time.monotonic()
    dbname = db_url.rsplit("/", 1)[1]
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND application_name LIKE 'drain pid=%%'", [dbname])
    standby = start_active_drain(db_url, batch_size=50)
    support.wait_for(lambda: support.queue_depth(queue) == 20, 30, "the standby to publish")
    support.wait_for(lambda: time.monotonic() - paused_at > pipeline.STALE_FETCH, 5,
                     "the fetch to be older than STALE_FETCH")
    thaw.set()
    support.wait_for(
        lambda: leader.drain.metrics.registry.get_sample_value("drain_stale_batches_total"),
        30, "the paused leader to drop its stale batch")
    # Published by the standby only, each once (a leader publishing its stale
    # batch would add 20 copies).
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.marker", ["after"], queue=queue)
    support.wait_for(lambda: support.queue_depth(queue) == 21, 30, "the marker")
    got = support.task_ids(support.drain_queue(queue))
    assert sorted(got[:20]) == sorted(ids) and len(got) == 21
    assert standby.drain.published == 21


@pytest.mark.parametrize("update", ["committed", "still open"])
def test_a_row_updated_under_the_batch_costs_that_row_only(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
    caplog: pytest.LogCaptureFixture, update: str,
) -> None:
    """A row updated after the batch read it is left staged and published again as
    it is now; the rest of the batch is deleted, committed, and the lock kept
    (drain.postgres.conflicts; issue 24, item 5). Committed after the batch's snapshot, the
    row's DELETE is a serialization failure, undone alone in a savepoint; still
    open, the row is locked and skipped without waiting for the writer."""
    caplog.set_level(logging.INFO, logger="drain")
    fetched = threading.Event()
    go_on = threading.Event()

    def hold_once(_elapsed: float, rows: int) -> None:
        if rows and not fetched.is_set():
            fetched.set()
            go_on.wait(30)

    running = start_active_drain(db_url, on_fetch=hold_once)
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.updated", ["before"], queue=queue)
        other = drain.stage(conn, "t.other", ["other"], queue=queue)
    support.wait_for(fetched.is_set, 30, "the drain to fetch the rows")
    with psycopg.connect(db_url) as writer:
        writer.execute("""UPDATE staged_jobs SET args = '["after"]'
                          WHERE task_name = 't.updated'""")
        if update == "committed":
            writer.commit()
        go_on.set()
        # The rest of the batch is deleted while the writer may still be open.
        support.wait_for(lambda: support.staged_count(db_url) == 1, 30, "the other row's delete")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the updated row")
    messages = support.drain_queue(queue)
    bodies = [json.loads(body)[0] for _, _, body in messages]
    assert sorted(bodies) == [["after"], ["before"], ["other"]], bodies
    assert bodies.index(["after"]) > bodies.index(["before"])
    assert support.task_ids(messages).count(str(other)) == 1
    metric = running.drain.metrics.registry.get_sample_value
    assert metric("drain_conflicted_rows_total") == 1
    assert metric("drain_unsettled_rows_total") == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "lock released" not in text and "rolled back" not in text
    assert text.count("active: took the drain lock") == 1
    assert "1 row(s) changed under the drain" in text
