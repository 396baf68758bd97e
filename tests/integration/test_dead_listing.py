"""``drain dead list`` stays cheap on a large dead_jobs (issue 39): every filter has
its index, the count stops at COUNT_CAP, and the statements run under a timeout.

The plans are read with EXPLAIN on a table the planner knows is large (50,000
rows, analysed), as the fetch query's index test does: no filter of the listing
may scan dead_jobs sequentially (but the count of everything, whose LIMIT stops
an unfiltered scan at COUNT_CAP + 1 rows).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from drain.errors import DrainError
from drain.postgres import dead
from tests import roles, support

ROWS = 50_000


def _fill(db_url: str) -> str:
    """ROWS dead jobs over 100 tasks, 10 queues, 7 tags and 4 reasons; one task id."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "tag, staged_at, reason, dead_at) SELECT i, gen_random_uuid(), 'dead.t' || (i %% 100), "
            "'[]', '{}', 'q' || (i %% 10), 0, 't' || (i %% 7), now(), "
            "(ARRAY['expired','invalid','refused','too_large'])[1 + i %% 4], "
            # Ties, as the drain makes them: a batch's dead jobs share their dead_at.
            "now() - (i / 1000) * interval '1 second' FROM generate_series(1, %s) AS i",
            (ROWS,))
        conn.execute("VACUUM ANALYZE dead_jobs")
        row = conn.execute("SELECT task_id::text FROM dead_jobs WHERE id = 777").fetchone()
    assert row is not None
    return str(row[0])


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


FILTERS = {
    "none": dead.Filters(),
    "reason": dead.Filters(reason="invalid"),
    "task": dead.Filters(task="dead.t7"),
    "queue": dead.Filters(queue="q3"),
    "tag": dead.Filters(tag="t5"),
    "older_than": dead.Filters(older_than=dt.timedelta(hours=10)),
    "two": dead.Filters(task="dead.t7", tag="t5"),
}


def test_every_filter_of_the_listing_is_an_index_scan(db_url: str) -> None:
    task_id = _fill(db_url)
    cases = {**FILTERS, "task_id": dead.Filters(task_id=uuid.UUID(task_id))}
    with psycopg.connect(roles.url(db_url, roles.OPERATOR)) as conn:
        for name, filters in cases.items():
            where, params = filters.where()
            for query in (
                sql.SQL("SELECT count(*) FROM (SELECT FROM dead_jobs WHERE {} LIMIT 10001) c"
                        ).format(where),
                sql.SQL("SELECT * FROM dead_jobs WHERE {} ORDER BY dead_at DESC, dead_id DESC "
                        "LIMIT 50").format(where),
            ):
                [[explained]] = conn.execute(
                    sql.SQL("EXPLAIN (FORMAT JSON) {}").format(query), params).fetchall()
                nodes = _plan_nodes(json.loads(explained)[0]["Plan"]
                                    if isinstance(explained, str) else explained[0]["Plan"])
                # A sequential scan reads the whole table unless it filters nothing and
                # nothing sorts its rows: the count's LIMIT then stops it early.
                sorts = [n for n in nodes if n["Node Type"] in ("Sort", "Incremental Sort")]
                seq = [n for n in nodes if n["Node Type"] == "Seq Scan"
                       and ("Filter" in n or sorts)]
                assert not seq, f"{name}: a sequential scan of dead_jobs:\n{explained}"
                # The index gives the order: a sort (of ties too) reads every match, but
                # for a task id's few rows, or two filters (one index, the other filters).
                assert not sorts or name in ("task_id", "two"), f"{name}: a sort:\n{explained}"
        total, found = dead.listing(conn, FILTERS["task"], 5)
    assert total == ROWS // 100 and len(found) == 5
    assert [r["task_name"] for r in found] == ["dead.t7"] * 5
    assert found == sorted(found, key=lambda r: r["dead_at"], reverse=True)


def test_the_count_stops_at_its_cap_and_a_slow_listing_is_one_clear_error(
    db_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fill(db_url)
    with psycopg.connect(roles.url(db_url, roles.OPERATOR)) as conn:
        assert dead.listing(conn, FILTERS["none"], 3, cap=100)[0] == 101
        assert dead.listing(conn, FILTERS["task"], 3, cap=1000)[0] == ROWS // 100
        monkeypatch.setattr(dead, "LIST_TIMEOUT", "1ms")
        with pytest.raises(DrainError, match=r"took more than 1ms: narrow it with --reason"):
            # A filter no index serves, made slow on purpose.
            dead.listing(conn, dead.Filters(older_than=dt.timedelta(seconds=-1e9)), 50,
                         cap=10**9)


def test_drain_dead_list_says_more_than_its_cap(db_url: str) -> None:
    _fill(db_url)
    ran = support.run_cli(db_url, "dead", "list", "--limit", "2")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[0] == (
        f"more than {dead.COUNT_CAP:,} dead job(s) match (no filter); the newest 2:")
    bad = support.run_cli(db_url, "dead", "list", "--task-id", "nope")
    assert bad.returncode == 2 and "not a task id (a UUID): 'nope'" in bad.stderr
