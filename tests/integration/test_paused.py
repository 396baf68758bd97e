"""A paused queue's rows do not tax every fetch, and are not forgotten (drain.postgres.keyset).

A queue the broker refuses to declare (here: it exists with other arguments,
406) is paused while its rows stay staged. The marks skip the paused rows, so
fetches for the other queues start past them; when the queue can be declared
again, every mark goes back to the start and the paused rows are delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psycopg
import pytest

import drain
from drain.postgres import keyset
from tests import support
from tests.integration.conftest import Running


@pytest.fixture
def refused_queue() -> Iterator[str]:
    """A queue declared with arguments the drain's plain declare does not match."""
    name = support.unique("drain_refused")
    with support.broker_channel() as ch:
        ch.queue_declare(name, durable=True, arguments={"x-max-length": 10})
    yield name
    support.delete_queue(name)


def _pile_top(db_url: str, queue: str) -> tuple[int, int]:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT max(xact)::text::bigint, max(id) FROM staged_jobs "
                           "WHERE queue = %s", [queue]).fetchone()
    assert row is not None and row[0] is not None
    return int(row[0]), int(row[1])


def test_marks_skip_a_paused_queue_and_come_back_for_it(
    db_url: str, queue: str, refused_queue: str,
    start_active_drain: Callable[..., Running],
) -> None:
    paused = support.stage_backlog(db_url, refused_queue, 3000)
    top = _pile_top(db_url, refused_queue)
    running = start_active_drain(db_url, rescan_interval=0.0)
    support.wait_for(lambda: refused_queue in running.drain.marks.skipping or None, 30,
                     "the refused queue to be paused and skipped")

    flowing = 0
    def mark_passed_the_pile() -> bool:
        nonlocal flowing
        with psycopg.connect(db_url, autocommit=True) as conn:  # commits that move the marks
            drain.stage(conn, "t.flow", [flowing], queue=queue)
        flowing += 1
        support.wait_for(lambda: support.staged_count(db_url) == len(paused), 30,
                         "the flowing job to be published")
        return running.drain.marks.marks().get(0, keyset.START) > top

    support.wait_for(mark_passed_the_pile, 60, "the mark to pass the paused rows")
    assert support.staged_count(db_url) == len(paused)

    # The queue can be declared again: its next retry finds the rows behind the mark.
    support.delete_queue(refused_queue)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 90,
                     "the paused rows to be delivered once the queue is accepted")
    support.check_at_least_once(support.drain_queue(refused_queue), paused)
    assert len(support.drain_queue(queue)) >= flowing
    assert running.drain.marks.rescans == 0
