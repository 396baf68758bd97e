"""The drain loop in-process against real Postgres and RabbitMQ.

Covers what the broker can refuse (queue declared with other arguments, a
queue that is missing, messages returned as unroutable), losing the database
session, and waking on NOTIFY rather than the poll interval.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

import drain
from drain.broker import corked
from drain.broker.outgoing import PauseKey
from drain.daemon.runner import State
from tests import support


def _stage(db_url: str, queue: str, n: int = 1) -> list[str]:
    with psycopg.connect(db_url) as conn:
        ids = drain.stage_many(conn, [drain.Job("celery_app.record", [i], queue=queue)
                                      for i in range(n)])
    return [str(i) for i in ids]


def test_publishes_then_deletes(db_url: str, queue: str, start_drain: Any) -> None:
    ids = _stage(db_url, queue, 2500)
    start_drain(db_url, batch_size=400)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the backlog to drain")
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(ids)


def test_a_batch_goes_to_the_socket_in_a_few_chunks_not_a_send_per_frame(
    db_url: str, queue: str, start_drain: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pika writes three frames per message and sends each on its own; the drain holds
    a batch's frames back and writes them joined (drain.broker.corked). This fails if
    pika stops writing through the transport the I/O services gave it."""
    joined: list[tuple[int, int]] = []
    real = corked.CorkedTransport.uncork

    def watched(self: corked.CorkedTransport, limit: int = corked.COALESCE_BYTES) -> int:
        before = self.writes
        held = real(self, limit)
        joined.append((held, self.writes - before))
        return held

    monkeypatch.setattr(corked.CorkedTransport, "uncork", watched)
    ids = _stage(db_url, queue, 1200)
    start_drain(db_url, batch_size=400)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the backlog to drain")
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(ids)
    held, writes = max(joined)
    assert held >= 3 * 400, joined  # a full batch: method, header and body frames
    assert 1 <= writes <= 8, joined


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_queue_with_other_arguments_keeps_its_rows_staged_and_others_flow(
    db_url: str, queue: str, other_queue: str, start_drain: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True, arguments={"x-max-priority": 10})
    _stage(db_url, queue, 3)
    others = _stage(db_url, other_queue, 4)
    caplog.set_level(logging.WARNING, logger="drain")
    running = start_drain(db_url)
    support.wait_for(lambda: _logged(caplog, "refused"), 30,
                     "the drain to report the refused declare")
    message = _logged(caplog, "refused")[0]
    assert f"queue {queue!r}" in message
    assert "PRECONDITION_FAILED" in message and "x-max-priority" in message
    assert "rows stay staged" in message
    support.wait_for(lambda: support.staged_count(db_url) == 3, 30,
                     "the other queue's rows to be published")
    assert sorted(support.task_ids(support.drain_queue(other_queue))) == sorted(others)
    assert support.queue_depth(queue) == 0
    assert running.drain.state is State.ACTIVE, "one refused queue is not a broker outage"


def test_passive_declare_publishes_to_a_queue_declared_elsewhere(
    db_url: str, queue: str, start_drain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ids = _stage(db_url, queue, 3)
    caplog.set_level(logging.WARNING, logger="drain")
    start_drain(db_url, queue_declare="passive")
    support.wait_for(lambda: _logged(caplog, "refused to check (passive declare)"), 30,
                     "the drain to notice the queue is missing")
    assert "404 NOT_FOUND" in _logged(caplog, "refused to check")[0]
    assert support.staged_count(db_url) == 3
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True, arguments={"x-max-priority": 10})
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30,
                     "the rows to drain once the queue exists")
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(ids)


def test_unroutable_messages_stay_staged(
    db_url: str, queue: str, start_drain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True)
    _stage(db_url, queue, 1)
    running = start_drain(db_url, queue_declare="passive")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the first job")
    # The drain checked the queue once; now it disappears behind the drain's back.
    support.delete_queue(queue)
    caplog.set_level(logging.WARNING, logger="drain")
    ids = _stage(db_url, queue, 2)
    support.wait_for(
        lambda: any("unroutable" in r.getMessage() for r in caplog.records), 30,
        "the drain to report unroutable messages",
    )
    assert support.staged_count(db_url) == 2, "returned messages must not be deleted"
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30,
                     "delivery once the queue is back")
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(ids)
    assert running.drain.published >= 3


def test_survives_losing_its_database_session(
    db_url: str, queue: str, start_drain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="drain")
    running = start_drain(db_url)
    support.wait_for(lambda: running.drain.state is State.ACTIVE, 30, "the drain to lead")
    dbname = db_url.rsplit("/", 1)[1]
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = %s AND application_name LIKE 'drain pid=%%'",
            (dbname,),
        ).fetchone()
    assert killed and killed[0] == 1
    ids = _stage(db_url, queue, 5)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30,
                     "the drain to reconnect and publish")
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(ids)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "lock released" in text
    assert text.count("active: took the drain lock") == 2


def test_wakes_on_notify_not_on_the_poll_interval(
    db_url: str, queue: str, start_drain: Any
) -> None:
    running = start_drain(db_url, poll_interval=300.0)
    support.wait_for(lambda: running.drain.state is State.ACTIVE, 30, "the drain to lead")
    support.wait_for(lambda: running.drain.published == 0 and support.staged_count(db_url) == 0,
                     5, "an idle drain")
    for round_ in range(3):
        _stage(db_url, queue, 1)
        # Far below the 300 s poll interval: only the NOTIFY can have woken it.
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                         f"the drain to wake on NOTIFY (round {round_})")


def test_a_refused_queue_is_retried_with_backoff_and_logged_once(
    db_url: str, queue: str, start_drain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True, arguments={"x-max-priority": 10})
    _stage(db_url, queue, 1)
    caplog.set_level(logging.DEBUG, logger="drain")
    running = start_drain(db_url)
    paused = running.drain.pipeline.paused
    support.wait_for(lambda: paused.get(PauseKey(queue), (0, 0, ""))[1] >= 3, 30,
                     "three refused declares")
    assert len(_logged(caplog, "refused")) == 1, "an unchanged refusal is logged once"
    # Fix the queue: the drain declares it again, delivers, and says so.
    support.delete_queue(queue)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "delivery after the fix")
    support.wait_for(lambda: _logged(caplog, f"queue {queue!r}: publishing again"), 10,
                     "the recovery line")


def test_a_row_that_can_never_be_a_message_is_dead_lettered_and_the_rest_flow(
    db_url: str, queue: str, start_drain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(db_url) as conn:
        # jsonb holds integers of any size; Python's JSON decoder refuses more than
        # 4300 digits, so this row cannot be turned into a message here.
        bad = conn.execute(
            "INSERT INTO staged_jobs (task_name, args, queue) "
            "VALUES ('t.bad', ('[1' || repeat('0', 5000) || ']')::jsonb, %s) RETURNING id",
            (queue,),
        ).fetchone()
    assert bad is not None
    ids = _stage(db_url, queue, 20)
    caplog.set_level(logging.INFO, logger="drain")
    start_drain(db_url, batch_size=7)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the batch to settle")
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(ids)
    with psycopg.connect(db_url) as conn:
        dead = conn.execute("SELECT id, reason, detail FROM dead_jobs").fetchall()
    assert len(dead) == 1 and dead[0][:2] == (bad[0], "invalid")
    assert "ValueError" in dead[0][2]
    messages = [r.getMessage() for r in caplog.records]
    assert "moved 1 job(s) to dead_jobs (reason 'invalid')" in messages
    assert messages.count("broker connected") == 1, "a bad row is not a broker failure"
