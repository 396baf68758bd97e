"""Lanes: N drains share the rows by id modulo N, each under its own lock."""

from __future__ import annotations

import re
from collections.abc import Callable

import psycopg

from drain.daemon.runner import State
from drain.postgres import status as drain_status
from tests import support
from tests.integration.conftest import Running


def test_two_lanes_publish_disjoint_halves_and_together_everything(
    db_url: str, queue: str, start_active_drain: Callable[..., Running]
) -> None:
    lanes = [start_active_drain(db_url, lanes=2, lane=k, batch_size=100) for k in (0, 1)]
    staged = support.stage_backlog(db_url, queue, 3000)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the backlog")
    messages = support.drain_queue(queue)
    copies = support.check_at_least_once(messages, staged)
    assert set(copies.values()) == {1}, "no fault happened: every job once"
    published = [r.drain.published for r in lanes]
    assert sum(published) == 3000
    assert published == [1500, 1500], "ids are consecutive: each lane owns every other one"


def test_a_second_process_for_the_same_lane_is_its_standby(
    db_url: str, queue: str, start_drain: Callable[..., Running],
    start_active_drain: Callable[..., Running],
) -> None:
    first = start_active_drain(db_url, lanes=2, lane=1)
    second = start_drain(db_url, lanes=2, lane=1)
    other = start_active_drain(db_url, lanes=2, lane=0)
    support.wait_for(lambda: second.drain.state is State.STANDBY, 30, "the standby")
    support.stage_backlog(db_url, queue, 10)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the rows")
    assert second.drain.published == 0
    assert first.drain.published + other.drain.published == 10
    with psycopg.connect(db_url) as conn:
        status = drain_status.read(conn, first.drain.settings.lock_key)
    assert not status["lock"]["held"]
    holders = status["lanes"]["2"]
    assert [h["lane"] for h in holders] == [0, 1] and all(h["held"] for h in holders)
    assert len({h["backend_pid"] for h in holders}) == 2
    first.stop()
    support.wait_for(lambda: second.drain.state is State.ACTIVE, 30, "the standby to take over")


def test_drains_split_in_a_different_number_of_lanes_refuse_to_publish(
    db_url: str, queue: str, start_drain: Callable[..., Running],
    start_active_drain: Callable[..., Running],
) -> None:
    start_active_drain(db_url, lanes=2, lane=0)
    # Lane 0 of 3 would publish ids 3, 6, 9...: some of them lane 0 of 2's as well.
    wrong = start_drain(db_url, lanes=3, lane=0)
    single = start_drain(db_url)
    support.wait_for(
        lambda: wrong.drain._lane_conflict and single.drain._lane_conflict, 30,
        "both to see the conflict",
    )
    assert re.search(r"run with --lanes (1, )?2 \(this one: --lanes 3\)",
                     str(wrong.drain._lane_conflict))
    assert wrong.drain.state is State.STANDBY and single.drain.state is State.STANDBY
    support.stage_backlog(db_url, queue, 10)
    support.wait_for(lambda: support.staged_count(db_url) == 5, 30, "lane 0's rows")
    assert wrong.drain.published == 0 and single.drain.published == 0
    with psycopg.connect(db_url) as conn:
        left = [r[0] % 2 for r in conn.execute("SELECT id FROM staged_jobs")]
    assert left == [1] * 5, "only lane 0 of 2 published"
