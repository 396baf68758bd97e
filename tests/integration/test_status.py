"""drain.postgres.status.read(): exact below the threshold, estimated above, cheap at any size."""

from __future__ import annotations

import json
from typing import Any

import psycopg

import drain
from drain.postgres import sql
from drain.postgres import status as drain_status
from tests import support


def _stage_groups(db_url: str) -> None:
    """3,000 jobs: 2,000 in queue a, 1,000 in queue b, every tenth of b delayed."""
    with psycopg.connect(db_url) as conn:
        drain.stage_many(conn, [drain.Job("t.a", [i], queue="a", tag="x") for i in range(2000)]
                         + [drain.Job("t.b", [i], queue="b",
                                      countdown=3600 if i % 10 == 0 else None)
                            for i in range(1000)])


def _live_rows_known(db_url: str, n: int) -> bool:
    """The statistics have caught up with the commits (they are flushed within a second)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT n_live_tup FROM pg_stat_user_tables "
                           "WHERE relname = 'staged_jobs'").fetchone()
        return row is not None and row[0] == n


def test_exact_below_the_threshold(db_url: str) -> None:
    _stage_groups(db_url)
    with psycopg.connect(db_url) as conn:
        status = drain_status.read(conn, 1)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert status["backlog"] == 3000 and status["delayed"] == 100
    assert not status["backlog_estimated"] and status["sample"] is None
    counts = {(g["queue"], g["task"]): (g["count"], g["delayed"]) for g in status["by_group"]}
    assert counts == {("a", "t.a"): (2000, 0), ("b", "t.b"): (1000, 100)}
    json.dumps(status)  # what `drain status --json` prints: plain JSON types only


def test_no_row_due_has_no_age(db_url: str) -> None:
    """An empty backlog, and one whose rows are all delayed into the future, have no
    oldest age (the metric reads 0), and neither has such a group; a due row's age is
    how long it has waited. (A clamp of min() once read "none" as year 1: 2,026 years,
    and the DrainBacklogOld alert fired on every idle drain.)"""
    with psycopg.connect(db_url) as conn:
        empty = drain_status.read(conn, 1)
        drain.stage(conn, "t.later", [1], queue="later", countdown=3600)
        conn.commit()
        later = drain_status.read(conn, 1)
        drain.stage(conn, "t.now", [1], queue="now")
        conn.commit()
        due = drain_status.read(conn, 1)
    assert empty["backlog"] == 0 and empty["oldest_age_seconds"] is None
    assert later["oldest_age_seconds"] is None
    assert [g["oldest_age_seconds"] for g in later["by_group"]] == [None]
    ages = {g["queue"]: g["oldest_age_seconds"] for g in due["by_group"]}
    assert ages["later"] is None
    assert 0 <= ages["now"] < 60
    assert due["oldest_age_seconds"] is not None and 0 <= due["oldest_age_seconds"] < 60


def test_estimated_above_the_threshold(db_url: str) -> None:
    _stage_groups(db_url)
    support.wait_for(lambda: _live_rows_known(db_url, 3000), 30, "n_live_tup = 3000")
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_relation_size('staged_jobs') / 8192").fetchone()
        assert row is not None
        pages = int(row[0])
        status = drain_status.read(conn, 1, estimate_above=1000, sample_pages=pages // 2)
    assert status["backlog_estimated"] is True
    assert status["backlog"] == 3000  # the statistics' estimate
    assert status["sample"]["percent"] == round(100.0 * (pages // 2) / pages, 3)
    # The sample is random; its groups are scaled to add up to the estimate.
    total = sum(g["count"] for g in status["by_group"])
    assert abs(total - 3000) <= len(status["by_group"])
    assert {g["queue"] for g in status["by_group"]} <= {"a", "b"}
    assert status["oldest_age_seconds"] is not None  # from the index heads: always there
    # Below the threshold again: exact.
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert not drain_status.read(conn, 1, estimate_above=3001)["backlog_estimated"]


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


def _explain(conn: psycopg.Connection[Any], name: str, params: Any = None) -> list[dict[str, Any]]:
    row = conn.execute("EXPLAIN (FORMAT JSON) " + sql.query(name), params).fetchone()
    assert row is not None
    return _plan_nodes(row[0][0]["Plan"])


def test_the_oldest_row_and_the_sample_do_not_scan_the_table(db_url: str) -> None:
    """Index heads and a block sample: the status stays cheap on a million-row backlog."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, priority, not_before) "
            "SELECT 't', g % 3, CASE WHEN g % 4 = 0 THEN now() + interval '1 day' END "
            "FROM generate_series(1, 50000) g")
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ANALYZE staged_jobs")
        nodes = _explain(conn, "backlog_oldest")
        scans = {(n["Node Type"], n.get("Index Name")) for n in nodes
                 if n.get("Relation Name") == "staged_jobs"}
        assert scans <= {("Index Scan", "staged_jobs_ready_idx"),
                         ("Index Only Scan", "staged_jobs_delayed_idx"),
                         ("Index Scan", "staged_jobs_delayed_idx")}, scans
        assert ("Index Scan", "staged_jobs_ready_idx") in scans
        nodes = _explain(conn, "backlog_groups_sample", {"percent": 1.0})
        assert [n["Node Type"] for n in nodes if n.get("Relation Name") == "staged_jobs"] \
            == ["Sample Scan"]


def _bury(db_url: str, reasons: dict[str, int]) -> None:
    """Rows straight into dead_jobs, ``{reason: count}``."""
    with psycopg.connect(db_url) as conn:
        for reason, n in reasons.items():
            conn.execute(
                "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, priority, "
                "staged_at, reason) SELECT g, gen_random_uuid(), 't', '[]', '{}', 0, now(), %s "
                "FROM generate_series(1, %s) g", (reason, n))


def _dead_rows_known(db_url: str, n: int) -> bool:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT n_live_tup FROM pg_stat_user_tables "
                           "WHERE relname = 'dead_jobs'").fetchone()
        return row is not None and row[0] == n


def test_dead_jobs_exact_below_the_threshold_estimated_above(db_url: str) -> None:
    """A table of dead jobs is counted by reason exactly while small; above the threshold
    the counts are scaled from a block sample, so a status read (and each metrics
    sample) stays cheap however many jobs died (bench/bench_curves.py, curve dead)."""
    _bury(db_url, {"expired": 3000, "invalid": 1000})
    support.wait_for(lambda: _dead_rows_known(db_url, 4000), 30, "n_live_tup = 4000")
    with psycopg.connect(db_url, autocommit=True) as conn:
        exact = drain_status.read(conn, 1)
        row = conn.execute("SELECT pg_relation_size('dead_jobs') / 8192").fetchone()
        assert row is not None
        pages = int(row[0])
        estimated = drain_status.read(conn, 1, estimate_above=1000, sample_pages=pages // 2)
        nodes = _explain(conn, "dead_by_reason_sample", {"percent": 1.0})
    assert exact["dead_by_reason"] == {"expired": 3000, "invalid": 1000}
    assert exact["dead_estimated"] is False and exact["dead_sample"] is None
    assert estimated["dead_estimated"] is True
    assert estimated["dead_sample"]["percent"] == round(100.0 * (pages // 2) / pages, 3)
    counts = estimated["dead_by_reason"]
    # Scaled to the statistics' estimate: they add up to it, give or take rounding.
    assert set(counts) <= {"expired", "invalid"} and abs(sum(counts.values()) - 4000) <= 2
    assert [n["Node Type"] for n in nodes if n.get("Relation Name") == "dead_jobs"] \
        == ["Sample Scan"]
    json.dumps(estimated)
