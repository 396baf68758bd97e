"""Piles of staged rows that stay (a refused queue's) do not grow each batch's cost.

Issue 36, item 3: the delete of the confirmed rows looks each one up by its key,
whatever sits staged below it; with ``--app``, rows held by id for a refused
queue are walked once, then passed by the marks: neither sent with every fetch
nor walked again each time the queue's pause runs out (drain.daemon.piles).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import drain
from drain.broker.outgoing import PauseKey
from drain.broker.queue_declare import QueueDeclaringLink
from drain.daemon import piles
from drain.postgres import sql
from drain.postgres.rows import StagedRow
from drain.postgres.store import Store
from drain.settings.config import Settings
from tests import roles, support
from tests.integration.conftest import Running


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found += _nodes(child)
    return found


def test_the_delete_of_confirmed_rows_reads_only_those_rows_whatever_the_pile(
    db_url: str, queue: str
) -> None:
    support.stage_backlog(db_url, "drain_pile_refused", 20_000)  # the pile, lowest ids
    support.stage_backlog(db_url, queue, 1000)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE staged_jobs")
        confirmed = conn.execute("SELECT id, xact::text FROM staged_jobs WHERE queue = %s "
                                 "ORDER BY id", [queue]).fetchall()
    store = Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    store.connect()  # the drain's own session settings
    try:
        conn = store._require()
        with conn.transaction(force_rollback=True):
            row = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.query("delete_confirmed"),
                {"ids": [r[0] for r in confirmed], "xacts": [r[1] for r in confirmed]},
            ).fetchone()
    finally:
        store.close()
    assert row is not None
    explained: Any = row[0]
    plan = explained[0]["Plan"]
    assert plan["Actual Rows"] == 1000  # every confirmed row deleted
    read = [node for node in _nodes(plan) if node.get("Relation Name") == "staged_jobs"
            and node["Node Type"] != "ModifyTable"]
    # One index lookup per confirmed id: the pile's 20,000 key entries stay unread.
    assert read and all(n["Node Type"] in ("Index Scan", "Index Only Scan") for n in read)
    entries = sum(n["Actual Rows"] * n["Actual Loops"] + n.get("Rows Removed by Filter", 0)
                  for n in read)
    assert entries <= 1000, (entries, plan)


@pytest.fixture
def pile_app() -> Iterator[dict[str, str]]:
    """tests/pile_app.py's queues; its held queue exists with other arguments (406)."""
    from tests import pile_app

    names = pile_app.NAMES
    with support.broker_channel() as ch:
        ch.queue_declare(names["held"], durable=True, arguments={"x-max-length": 10})
    yield names
    for name in names.values():
        support.delete_queue(name)


def _stage(db_url: str, task: str, n: int) -> None:
    """``n`` rows without a queue: the app routes them."""
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        drain.stage_many(conn, (drain.Job(task, [i]) for i in range(n)))


@pytest.mark.parametrize("app", ["app", "by_function", "by_arguments"])
def test_rows_held_for_the_app_are_walked_at_most_once_and_not_sent_with_every_fetch(
    db_url: str, pile_app: dict[str, str], start_active_drain: Callable[..., Running],
    monkeypatch: pytest.MonkeyPatch, app: str,
) -> None:
    """A static app's held rows are held by route, and so are those of a router
    function that routes them without looking at their arguments: the pile is not
    even walked once. Those of a router function that looks at the arguments are
    held by id: walked once, then passed by the marks."""
    pile, batch = 3000, 500
    _stage(db_url, "pile.held", pile)
    fetches: list[tuple[int, int]] = []  # (ids left out, rows fetched)
    fetch = Store.fetch

    def counted(self: Store, limit: int, exclude: list[int] | None = None,
                *args: Any, **options: Any) -> list[StagedRow]:
        rows = fetch(self, limit, exclude, *args, **options)
        fetches.append((len(exclude or []), len(rows)))
        return rows

    monkeypatch.setattr(Store, "fetch", counted)
    running = start_active_drain(db_url, celery_app=f"tests.pile_app:{app}",
                                 batch_size=batch, rescan_interval=0.0)
    holds = running.drain.pipeline.holds
    held = PauseKey(pile_app["held"])
    if app != "by_arguments":
        support.wait_for(lambda: held in holds.paused or None, 60,
                         "the refused queue to be paused")
    else:
        # Held: in Holds.rows, or set aside once the marks passed them (HeldKeys.passed).
        piles = running.drain.pipeline.piles
        support.wait_for(lambda: len(holds.rows) + len(piles.passed) >= pile or None, 60,
                         "the pile to be held")
    walked = sum(rows for _, rows in fetches)
    paused = holds.paused[held][1]
    fetches.clear()

    # Good rows trickle in while the refused queue's pause runs out twice.
    good = 0
    while holds.paused[held][1] < paused + 2:
        _stage(db_url, "pile.good", 1)
        good += 1
        support.wait_for(lambda: support.staged_count(db_url) == pile, 30,
                         "the good row to be published")
    assert support.staged_count(db_url) == pile  # the pile stays staged
    # Not the held ids with every fetch: only those the marks had not passed yet. A
    # transaction open elsewhere in the cluster (another test's, in parallel) holds the
    # marks back while it lasts (drain.daemon.piles): then the next fetches pass them.
    support.wait_for(lambda: fetches[-1][0] <= 2 * batch or None, 60,
                     "a fetch that leaves out only the held ids the marks did not pass")
    # The pile is not walked again when the pause runs out and the queue is still refused.
    assert sum(rows for _, rows in fetches) <= good + batch
    if app != "by_arguments":  # held by route from the first batch on: never walked
        assert walked + sum(rows for _, rows in fetches) <= good + 2 * batch
    else:
        assert walked >= pile  # each row routed by its arguments, so walked once
    assert len(support.drain_queue(pile_app["good"])) >= good


def test_a_router_function_that_changes_its_answer_lets_its_held_route_go(
    db_url: str, pile_app: dict[str, str], start_active_drain: Callable[..., Running],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows held by route on a router function's answer are not held on it for
    good: the router is asked again (drain.daemon.piles, HeldKeys.recheck) and,
    once it sends the task elsewhere, every row of the route is fetched, routed
    and published there, while the first queue is still refused."""
    from tests import pile_app as module

    pile = 1500
    _stage(db_url, "pile.held", pile)
    running = start_active_drain(db_url, celery_app="tests.pile_app:by_flag",
                                 batch_size=500, rescan_interval=0.0)
    pipeline = running.drain.pipeline
    held = PauseKey(pile_app["held"])
    support.wait_for(lambda: held in pipeline.piles.routes.values() or None, 60,
                     "the pile to be held by route")
    assert support.staged_count(db_url) == pile
    monkeypatch.setattr(module, "HELD_TO", "good")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                     "the held rows to be published where the router sends them now")
    assert held in pipeline.holds.paused  # the first queue is refused all along
    bodies = support.drain_queue(pile_app["good"])
    assert len({props.correlation_id for _, props, _ in bodies}) == pile


def test_many_refused_queues_are_one_warning_and_declared_again_a_chunk_at_a_time(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = [support.unique("drain_rq") for _ in range(200)]
    with support.broker_channel() as ch:
        for name in refused:
            ch.queue_declare(name, durable=True, arguments={"x-max-length": 10})
    try:
        with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
            drain.stage_many(conn, (drain.Job("t.refused", [i], queue=name)
                                    for i, name in enumerate(refused)))
        calls: list[int] = []  # queues refused per declare call
        declare = QueueDeclaringLink.declare

        def counted(self: QueueDeclaringLink, queues: set[str], **options: Any) -> dict[str, str]:
            answer = declare(self, queues, **options)
            if answer:
                calls.append(len(answer))
            return answer

        monkeypatch.setattr(QueueDeclaringLink, "declare", counted)
        # Short enough that 200 refused declares never fit in one batch's budget.
        monkeypatch.setattr(piles, "DECLARE_BUDGET", 0.02)
        caplog.set_level(logging.WARNING, logger="drain")
        running = start_active_drain(db_url)
        holds = running.drain.pipeline.holds
        support.wait_for(lambda: all(holds.paused.get(PauseKey(n), (0, 0, ""))[1] >= 3
                                             for n in refused)
                         or None, 60, "every refused queue to be declared again twice")
        # Never 200 declares in one batch: the first batches declare new queues for
        # DECLARE_BUDGET each, and once due they are tried again a chunk per cycle.
        assert max(calls) < len(refused), calls
        assert max(calls[-10:]) <= piles.DUE_PER_CYCLE, calls
        said = [r for r in caplog.records
                if r.levelno >= logging.WARNING and "refused to declare" in r.getMessage()]
        # One cause, one warning; on a busy machine the first batch's declares may
        # come back one refusal at a time, and the first is said on its own
        # (tests/unit/test_refusals.py).
        grouped = [r for r in said if "queues (406)" in r.getMessage()]
        assert len(grouped) == 1 and len(said) <= 2, [r.getMessage()[:80] for r in said]
        staged = support.stage_backlog(db_url, queue, 1)  # a healthy queue flows meanwhile
        support.wait_for(lambda: support.staged_count(db_url) == len(refused), 30,
                         "the healthy job to be published")
        support.check_at_least_once(support.drain_queue(queue), staged)
    finally:
        for name in refused:
            support.delete_queue(name)
