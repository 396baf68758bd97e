"""Publishing paused by an operator (drain.postgres.pauses, issue 39).

A pause lives in ``drain_pauses``; the drain reads it in its next batch's
snapshot when its trigger notifies (drain.daemon.operators):

* a paused queue's jobs stay staged while the other queues' flow, staging into
  it goes on, and once resumed every one is delivered (the marks passed the
  paused rows and go back for them: no rescan);
* a pause taken in the middle of a backlog stops that queue within the
  batches under way, and loses nothing;
* a paused task stays staged in a queue whose other tasks flow;
* with ``--app``, a queue is paused where the app routes the job;
* the pause and the resume run as the operator role, each with its audit row.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

import drain
from drain.postgres import audit, dead, pauses
from drain.settings.config import Settings
from tests import pause_app, roles, support
from tests.integration.conftest import Running


def _operator(db_url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(roles.url(db_url, roles.OPERATOR), autocommit=True)


def _pause(db_url: str, kind: str, name: str) -> None:
    with _operator(db_url) as conn:
        assert pauses.pause(conn, kind, name, reason="a test", actor="tester") is not None


def _resume(db_url: str, kind: str, name: str) -> None:
    with _operator(db_url) as conn:
        assert pauses.resume(conn, kind, name, reason="done", actor="tester") is not None


def _staged_in(db_url: str, column: str, value: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(f"SELECT count(*) FROM staged_jobs WHERE {column} = %s",
                           [value]).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def queues() -> Iterator[tuple[str, str]]:
    names = (support.unique("drain_op_paused"), support.unique("drain_op_flowing"))
    yield names
    for name in names:
        support.delete_queue(name)


def test_a_paused_queue_stays_staged_while_others_flow_and_comes_back(
    db_url: str, queues: tuple[str, str], start_active_drain: Callable[..., Running],
) -> None:
    paused, flowing = queues
    _pause(db_url, "queue", paused)
    held = support.stage_backlog(db_url, paused, 300)
    first = support.stage_backlog(db_url, flowing, 300)
    running = start_active_drain(db_url, rescan_interval=0.0, batch_size=100)
    support.wait_for(lambda: _staged_in(db_url, "queue", flowing) == 0 or None, 60,
                     "the other queue's jobs to be published")
    # Staging into the paused queue goes on; the other queue's new jobs flow past it.
    more = support.stage_backlog(db_url, paused, 50)
    later = support.stage_backlog(db_url, flowing, 50)
    support.wait_for(lambda: _staged_in(db_url, "queue", flowing) == 0 or None, 60,
                     "the other queue's later jobs to be published")
    assert _staged_in(db_url, "queue", paused) == 350
    assert support.queue_depth(paused) == 0
    assert paused in running.drain.marks.skipping  # the marks passed the paused rows

    _resume(db_url, "queue", paused)
    support.wait_for(lambda: support.staged_count(db_url) == 0 or None, 60,
                     "the paused queue's jobs to be published once resumed")
    support.check_at_least_once(support.drain_queue(paused), {**held, **more})
    support.check_at_least_once(support.drain_queue(flowing), {**first, **later})
    assert running.drain.marks.rescans == 0


def test_a_pause_in_the_middle_of_a_backlog_stops_it_within_the_batches_under_way(
    db_url: str, queues: tuple[str, str], start_active_drain: Callable[..., Running],
) -> None:
    paused, flowing = queues
    batch, depth = 50, 2
    held = support.stage_backlog(db_url, paused, 4000)
    running = start_active_drain(db_url, batch_size=batch, pipeline=depth)
    support.wait_for(lambda: running.drain.published >= 200 or None, 60,
                     "the backlog to be under way")
    _pause(db_url, "queue", paused)
    at_pause = running.drain.published
    # Jobs staged after the pause, in another queue, are published: the drain goes on.
    later = support.stage_backlog(db_url, flowing, 20)
    support.wait_for(lambda: _staged_in(db_url, "queue", flowing) == 0 or None, 60,
                     "the other queue's jobs to be published during the pause")
    after = running.drain.published - 20
    # The batches in flight and the one under way when the pause committed may
    # finish, and one more in the race of the notification with its BEGIN.
    assert after - at_pause <= (depth + 2) * batch, (at_pause, after)
    assert _staged_in(db_url, "queue", paused) == 4000 - after > 0

    _resume(db_url, "queue", paused)
    support.wait_for(lambda: support.staged_count(db_url) == 0 or None, 90,
                     "the rest of the backlog once resumed")
    support.check_at_least_once(support.drain_queue(paused), held)
    support.check_at_least_once(support.drain_queue(flowing), later)


def test_a_paused_task_stays_staged_while_its_queue_flows(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
) -> None:
    _pause(db_url, "task", "t.paused")
    ids: dict[str, list[str]] = {"t.paused": [], "t.other": []}
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        for i in range(40):
            for task, staged in ids.items():
                staged.append(str(drain.stage(conn, task, [i], queue=queue)))
    running = start_active_drain(db_url, rescan_interval=0.0)
    support.wait_for(lambda: _staged_in(db_url, "task_name", "t.other") == 0 or None, 60,
                     "the other task's jobs to be published")
    assert _staged_in(db_url, "task_name", "t.paused") == 40
    assert "\x1ftask:t.paused" in running.drain.marks.skipping
    _resume(db_url, "task", "t.paused")
    support.wait_for(lambda: support.staged_count(db_url) == 0 or None, 60,
                     "the paused task's jobs once resumed")
    got = support.task_ids(support.drain_queue(queue))
    assert sorted(set(got)) == sorted(ids["t.paused"] + ids["t.other"])
    # The paused task's jobs came after the other's: none was published while paused.
    assert set(got[:40]) == set(ids["t.other"])


@pytest.fixture
def suffix() -> Iterator[str]:
    value = uuid.uuid4().hex[:10]
    yield value
    pause_app.delete_entities(value)


def test_with_app_a_queue_is_paused_where_the_app_routes_it(
    db_url: str, suffix: str,
) -> None:
    names = pause_app.names(suffix)
    _pause(db_url, "queue", names["healthy"])
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        # Staged without a queue: the app routes them (tests/pause_app.py).
        healthy = [str(drain.stage(conn, "pause.healthy", [i])) for i in range(30)]
        via = [str(drain.stage(conn, "pause.via_exchange", [i])) for i in range(30)]
    running = Running(Settings(database_url=roles.url(db_url, roles.RUNNER),
                               broker_url=support.BROKER_URL, poll_interval=0.2,
                               max_backoff=0.5, celery_app=f"tests.pause_app:app_{suffix}"))
    try:
        support.wait_for(lambda: _staged_in(db_url, "task_name", "pause.via_exchange") == 0
                         or None, 60, "the jobs routed elsewhere to be published")
        assert _staged_in(db_url, "task_name", "pause.healthy") == 30
        assert support.queue_depth(names["healthy"]) == 0
        _resume(db_url, "queue", names["healthy"])
        support.wait_for(lambda: support.staged_count(db_url) == 0 or None, 60,
                         "the paused queue's jobs once resumed")
    finally:
        running.stop()
    assert sorted(support.task_ids(support.drain_queue(names["healthy"]))) == sorted(healthy)
    assert sorted(support.task_ids(support.drain_queue(names["via"]))) == sorted(via)


def test_pause_and_resume_are_audited_and_said_once(db_url: str) -> None:
    with _operator(db_url) as conn:
        assert pauses.pause(conn, "queue", "q1", reason="maintenance", actor="ann") is not None
        # Paused already: nothing changes, nothing is recorded.
        assert pauses.pause(conn, "queue", "q1", reason="again", actor="bob") is None
        assert [(p.kind, p.name, p.reason, p.paused_by) for p in pauses.current(conn)] == [
            ("queue", "q1", "maintenance", "ann")]
        assert pauses.resume(conn, "queue", "q1", reason=None, actor="bob") is not None
        assert pauses.resume(conn, "queue", "q1", reason=None, actor="bob") is None
        found = audit.entries(conn, limit=10)
    assert [(e["action"], e["actor"], e["target"], e["reason"], e["db_role"])
            for e in found] == [
        ("resume", "bob", {"queue": "q1"}, None, roles.OPERATOR),
        ("pause", "ann", {"queue": "q1"}, "maintenance", roles.OPERATOR)]


def test_the_runner_and_the_stager_cannot_pause(db_url: str) -> None:
    for role in (roles.RUNNER, roles.STAGER):
        with psycopg.connect(roles.url(db_url, role), autocommit=True) as conn, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            pauses.pause(conn, "queue", "q", reason="no", actor=role)
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM drain_pauses").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM drain_audit").fetchone() == (0,)


def test_a_requeue_while_the_drain_publishes_loses_nothing(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
) -> None:
    """Dead jobs requeued in the middle of a backlog (issue 39, an action racing a
    running drain): every staged and every requeued job is delivered, with its task
    id, and nothing stays behind."""
    staged = support.stage_backlog(db_url, queue, 20_000)
    requeued = {str(uuid.uuid4()): i for i in range(20_000, 20_300)}
    with psycopg.connect(db_url) as conn:
        for task_id, i in requeued.items():
            conn.execute(
                "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
                "staged_at, reason) VALUES (%s, %s, 'celery_app.record', %s, %s, %s, 0, now(), "
                "'refused')", (-i, task_id, f"[{i}]", f'{{"i": {i}}}', queue))
    running = start_active_drain(db_url, batch_size=100)
    support.wait_for(lambda: running.drain.published >= 500 or None, 60,
                     "the backlog to be under way")
    with _operator(db_url) as conn:
        moved = dead.requeue(conn, dead.Filters(queue=queue), act=dead.Act("tester", "race"))
        left = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert moved == len(requeued)
    # The requeued jobs, and some of the backlog still: they raced.
    assert left is not None and int(str(left[0])) > len(requeued), "the backlog was over"
    support.wait_for(lambda: support.staged_count(db_url) == 0 or None, 90,
                     "the backlog and the requeued jobs to be published")
    support.check_at_least_once(support.drain_queue(queue), {**staged, **requeued})
