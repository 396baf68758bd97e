"""A queue that does not confirm holds back only its own jobs (drain.daemon.confirms,
``Confirms.collect``; issue 36).

The fault is real: the queue's own Erlang process on the test's RabbitMQ is
suspended (``sys:suspend``), so the broker takes its messages and confirms none
until it is resumed, while every other queue confirms as usual. A job for it
shares its batch with jobs for a healthy queue, and more follow.

Before, a batch was collected whole, oldest first: the drain published
``pipeline`` batches and then waited for the one with the silent message, up to
the confirm timeout, while every other queue's jobs waited with it; at the end
of a backlog, and for each lone job, the same. Now the window counts messages:
the healthy queue's rows are confirmed and deleted, in that batch and the ones
after it, while the silent message stays in flight, and once the queue confirms
it its row goes too, each job delivered once.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from drain.daemon.runner import State
from tests import support
from tests.integration.conftest import Running, queue_process


def _staged_ids(db_url: str) -> set[str]:
    with support.connect(db_url) as conn:
        return {str(row[0]) for row in conn.execute("SELECT task_id FROM staged_jobs")}


def _start(start_active_drain: Callable[..., Running], db_url: str, queue: str,
           other_queue: str) -> tuple[Running, dict[str, int], dict[str, int]]:
    """A drain with small batches and a confirm timeout no test run reaches, whose
    first jobs have declared both queues (a declare would wait for a silent queue);
    those first jobs, by queue."""
    running = start_active_drain(db_url, batch_size=10, pipeline=2, confirm_timeout=600.0)
    first = support.stage_backlog(db_url, queue, 1), support.stage_backlog(db_url, other_queue, 1)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the first jobs")
    assert running.drain.state is State.ACTIVE
    return running, *first


@pytest.mark.parametrize("healthy", [200, 1], ids=["backlog", "lone-jobs"])
def test_a_queue_that_does_not_confirm_holds_back_only_its_own_jobs(
    db_url: str, queue: str, other_queue: str, *, healthy: int,
    start_active_drain: Callable[..., Running], silence: Callable[[str], None],
) -> None:
    running, stuck, flowing = _start(start_active_drain, db_url, queue, other_queue)
    silence(queue)
    silent = support.stage_backlog(db_url, queue, 1)
    stuck |= silent
    flowing |= support.stage_backlog(db_url, other_queue, healthy)
    # With lone jobs: more of them, each committed on its own while the first waits.
    for _ in range(5 if healthy == 1 else 0):
        flowing |= support.stage_backlog(db_url, other_queue, 1)
    support.wait_for(lambda: _staged_ids(db_url) == set(silent), 60,
                     "the healthy queue's jobs, while the other queue confirms nothing")
    assert running.drain.published == 1 + len(flowing)
    queue_process(queue, "resume")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                     "the silent queue's job, once it confirms")
    for name, staged in ((queue, stuck), (other_queue, flowing)):
        copies = support.check_at_least_once(support.drain_queue(name), staged)
        assert set(copies.values()) == {1}, f"{name}: a job delivered more than once"
