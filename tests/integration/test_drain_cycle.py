"""The drain loop in-process against real Postgres and RabbitMQ.

Covers what the broker can refuse (queue declared with other arguments, a
queue that is missing, messages returned as unroutable), losing the database
session, and waking on NOTIFY rather than the poll interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import drain
from drain.config import Settings
from drain.runner import Drain, State
from tests import support


class Running:
    """A Drain running in a background thread, stopped at the end of the test."""

    def __init__(self, settings: Settings) -> None:
        self.drain = Drain(settings)
        self.thread = threading.Thread(target=self.drain.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.drain.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the drain did not stop"


@pytest.fixture
def start_drain() -> Iterator[Any]:
    running: list[Running] = []

    def _start(db_url: str, **overrides: Any) -> Running:
        settings = Settings(database_url=db_url, broker_url=support.BROKER_URL,
                            **{"poll_interval": 0.2, "max_backoff": 0.5, **overrides})
        r = Running(settings)
        running.append(r)
        return r

    yield _start
    for r in running:
        r.stop()


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


def test_queue_with_other_arguments_keeps_rows_staged(
    db_url: str, queue: str, start_drain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True, arguments={"x-max-priority": 10})
    _stage(db_url, queue, 3)
    caplog.set_level(logging.WARNING, logger="drain")
    running = start_drain(db_url)
    support.wait_for(lambda: running.drain.state is State.BROKER_DOWN, 30,
                     "the drain to report the refused declare")
    message = next(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    assert f"queue {queue!r}" in message
    assert "PRECONDITION_FAILED" in message and "x-max-priority" in message
    assert "rows stay staged" in message
    assert support.staged_count(db_url) == 3
    assert support.queue_depth(queue) == 0


def test_passive_declare_publishes_to_a_queue_declared_elsewhere(
    db_url: str, queue: str, start_drain: Any
) -> None:
    ids = _stage(db_url, queue, 3)
    running = start_drain(db_url, queue_declare="passive")
    support.wait_for(lambda: running.drain.state is State.BROKER_DOWN, 30,
                     "the drain to notice the queue is missing")
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


def test_a_refused_declare_is_retried_with_backoff_not_in_a_hot_loop(
    db_url: str, queue: str, start_drain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True, arguments={"x-max-priority": 10})
    _stage(db_url, queue, 1)
    caplog.set_level(logging.DEBUG, logger="drain")
    running = start_drain(db_url, max_backoff=0.4)
    support.wait_for(
        lambda: sum("refused" in r.getMessage() for r in caplog.records) >= 1
        and running.drain._failures["broker"] >= 4,
        30, "several retries of the refused declare",
    )
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, "an unchanged failure is logged once"
    assert not any(r.getMessage() == "broker connected" for r in caplog.records[1:]
                   if r.created > refusals[0].created)
    # Now fix the queue: the drain delivers and says it is back.
    support.delete_queue(queue)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "delivery after the fix")
    support.wait_for(
        lambda: any("broker back" in r.getMessage() for r in caplog.records), 10,
        "the recovery line",
    )


def test_a_row_that_cannot_become_a_message_does_not_stop_the_others(
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
    support.wait_for(lambda: support.staged_count(db_url) == 1, 30, "the good rows to drain")
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(ids)
    messages = [r.getMessage() for r in caplog.records]
    errors = [m for m in messages if f"staged row {bad[0]} " in m]
    assert len(errors) == 1 and "stays staged" in errors[0]
    assert messages.count("broker connected") == 1, "a bad row is not a broker failure"
