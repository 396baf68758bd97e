"""A pause is keyed by what failed, with ``--app`` (drain.daemon.holds, issue 36).

Every job is staged without a queue (its row reads as 'celery') and routed by
the app's ``task_routes`` (tests/pause_app.py), as ``drain run --app`` does:

* a full queue (``x-overflow: reject-publish``) pauses that queue only: the
  jobs routed to a healthy queue go out while it is still full, the log names
  the full queue, and a confirm once there is room resets its backoff (before:
  the staged queue 'celery' was paused, holding every job for up to 30 s, the log
  named 'celery' and its backoff was never reset);
* two routes to exchanges with no queue: returns for one never hold the other
  (before: both shared one key, 'amq.drain: nothing declared');
* an exchange the drain declared, deleted twice on one connection: declared
  again each time, nothing dead-lettered (before: the second time every job
  routed there went to dead_jobs as 'refused' until a reconnect).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

import drain
from drain.settings.config import Settings
from tests import pause_app, roles, support
from tests.integration.conftest import Running


@pytest.fixture
def suffix() -> Iterator[str]:
    value = uuid.uuid4().hex[:10]
    yield value
    pause_app.delete_entities(value)


def _run(db_url: str, suffix: str) -> Running:
    return Running(Settings(database_url=roles.url(db_url, roles.RUNNER),
                            broker_url=support.BROKER_URL, poll_interval=0.2, max_backoff=0.5,
                            celery_app=f"tests.pause_app:app_{suffix}"))


def _stage(db_url: str, task: str, n: int) -> list[str]:
    """Stage ``n`` jobs of ``task`` without a queue, one transaction each, as the app."""
    ids = []
    for i in range(n):
        with support.connect(roles.url(db_url, roles.STAGER)) as conn:
            ids.append(str(drain.stage(conn, task, [i])))
    return ids


def _staged(db_url: str, task: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs WHERE task_name = %s",
                           [task]).fetchone()
    assert row is not None
    return int(row[0])


def _paused(running: Running) -> list[str]:
    """What is paused, as the log names it."""
    return sorted(str(key) for key in running.drain.pipeline.paused)


def _sample(running: Running, name: str, labels: dict[str, str] | None = None) -> float:
    return running.drain.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_a_full_queue_pauses_itself_not_the_jobs_staged_without_a_queue(
    db_url: str, suffix: str, caplog: pytest.LogCaptureFixture
) -> None:
    n = pause_app.names(suffix)
    full, healthy = n["full"], n["healthy"]
    with support.broker_channel() as ch:
        ch.queue_declare(full, durable=True, arguments=pause_app.FULL_ARGUMENTS)
        ch.basic_publish("", full, b"filler")
    caplog.set_level(logging.INFO, logger="drain")
    _stage(db_url, "pause.full", 1)
    running = _run(db_url, suffix)
    try:
        support.wait_for(lambda: _sample(running, "drain_nacked_total") >= 1, 30, "a nack")
        # Jobs to the healthy queue, staged while the full one is paused.
        staged_at = time.monotonic()
        healthy_ids = _stage(db_url, "pause.healthy", 5)
        support.wait_for(lambda: _staged(db_url, "pause.healthy") == 0, 60,
                         "the healthy queue's jobs")
        took = time.monotonic() - staged_at
        print(f"\n[pause keys] 5 jobs to a healthy queue delivered {took:.2f}s after staging, "
              f"while the full queue was full")
        paused = _paused(running)
        assert _staged(db_url, "pause.full") == 1
        assert support.queue_depth(full) == 1  # still full: the filler alone
        # What was paused is the full queue, never the staged queue 'celery'.
        assert paused in ([], [f"queue {full!r}"]), paused
        nacked = [r.getMessage() for r in caplog.records if "nacks" in r.getMessage()]
        assert nacked and all(repr(full) in line and "'celery'" not in line
                              for line in nacked), nacked

        # Room again: the held job goes out, and the confirm resets the backoff.
        with support.broker_channel() as ch:
            assert ch.basic_get(full, auto_ack=True)[2] == b"filler"
        support.wait_for(lambda: _staged(db_url, "pause.full") == 0, 60,
                         "the nacked job once there is room")
        holds = running.drain.pipeline.holds
        support.wait_for(lambda: not holds.paused and not holds.held, 30,
                         "the backoff reset by the confirm")
        # Full again: the next nack pauses it as the first one did (1 s), not 30 s.
        support.wait_for(lambda: support.queue_depth(full) == 1, 30, "the job in its queue")
        _stage(db_url, "pause.full", 1)
        support.wait_for(lambda: holds.paused, 30, "the next nack's pause")
        assert [(str(key), times) for key, (_, times, _) in holds.paused.items()] == [
            (f"queue {full!r}", 1)]
        assert holds.held == {key: 1 for key in holds.paused}
        assert _sample(running, "drain_reconnects_total", {"target": "broker"}) == 0
    finally:
        running.stop()
    assert sorted(support.task_ids(support.drain_queue(healthy))) == sorted(healthy_ids)


def test_returns_for_one_exchange_never_hold_a_route_to_another(
    db_url: str, suffix: str, caplog: pytest.LogCaptureFixture
) -> None:
    n = pause_app.names(suffix)
    exchange_a, exchange_b, bound_b = n["exchange_a"], n["exchange_b"], n["bound_b"]
    with support.broker_channel() as ch:
        ch.exchange_declare(exchange_a, exchange_type="topic", durable=True)
        ch.exchange_declare(exchange_b, exchange_type="topic", durable=True)
        ch.queue_declare(bound_b, durable=True)
        ch.queue_bind(bound_b, exchange_b, routing_key="b.#")
    caplog.set_level(logging.INFO, logger="drain")
    a_ids = _stage(db_url, "pause.to_a", 1)
    running = _run(db_url, suffix)
    try:
        support.wait_for(lambda: _sample(running, "drain_unroutable_total") >= 1, 30,
                         "a return")
        staged_at = time.monotonic()
        b_ids = _stage(db_url, "pause.to_b", 5)
        support.wait_for(lambda: _staged(db_url, "pause.to_b") == 0, 60,
                         "the jobs to exchange B")
        took = time.monotonic() - staged_at
        print(f"\n[pause keys] 5 jobs to exchange B delivered {took:.2f}s after staging, "
              f"while exchange A returned its job")
        paused = _paused(running)
        assert _staged(db_url, "pause.to_a") == 1
        assert paused in ([], [f"exchange {exchange_a!r} routing key 'a.job'"]), paused
        returned = [r.getMessage() for r in caplog.records if "unroutable" in r.getMessage()]
        assert returned and all(repr(exchange_a) in line and "nothing declared" not in line
                                for line in returned), returned
        # A queue bound to A at last: its job goes out.
        with support.broker_channel() as ch:
            ch.queue_declare(n["bound_a"], durable=True)
            ch.queue_bind(n["bound_a"], exchange_a, routing_key="a.#")
        support.wait_for(lambda: _staged(db_url, "pause.to_a") == 0, 60,
                         "the job to exchange A once a queue is bound")
    finally:
        running.stop()
    assert sorted(support.task_ids(support.drain_queue(bound_b))) == sorted(b_ids)
    assert support.task_ids(support.drain_queue(n["bound_a"])) == a_ids


def test_an_exchange_the_drain_declared_deleted_twice_is_declared_again_each_time(
    db_url: str, suffix: str
) -> None:
    via = pause_app.names(suffix)["via"]
    running = _run(db_url, suffix)
    delivered: list[str] = []
    try:
        delivered += _stage(db_url, "pause.via_exchange", 1)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the first job")
        for round_, count in enumerate((2, 3)):
            with support.broker_channel() as ch:
                ch.exchange_delete(via)  # behind the drain's back, on its connection
            delivered += _stage(db_url, "pause.via_exchange", count)
            support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                             f"the jobs after deletion {round_ + 1}")
        refused = _sample(running, "drain_publish_refused_total", {"code": "404"})
        dead = _sample(running, "drain_dead_lettered_total", {"reason": "refused"})
        reconnects = _sample(running, "drain_reconnects_total", {"target": "broker"})
    finally:
        running.stop()
    with psycopg.connect(db_url) as conn:
        dead_rows = conn.execute("SELECT count(*) FROM dead_jobs").fetchone()
    print(f"\n[pause keys] exchange deleted twice: {refused:g} refused publishes, "
          f"{dead_rows} dead-lettered rows")
    assert dead_rows == (0,) and dead == 0
    assert refused >= 2  # one refusal per deletion at least
    assert reconnects == 0, "a redeclare, not a reconnect, cured it"
    assert sorted(set(support.task_ids(support.drain_queue(via)))) == sorted(delivered)
