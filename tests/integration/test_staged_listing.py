"""``drain staged list`` (issue 39): the head of the backlog, filtered, never a scan of
the whole of staged_jobs (drain.postgres.staged)."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from psycopg import sql

from drain.postgres import staged
from tests import roles, support

ROWS = 50_000


def _fill(db_url: str) -> None:
    """ROWS ready jobs over 3 tasks and 2 priorities, kwargs {"user": i % 5}; 10 delayed."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, args, kwargs, queue, priority) "
            "SELECT 't' || (i %% 3), jsonb_build_array(i), jsonb_build_object('user', i %% 5), "
            "'q', i %% 2 FROM generate_series(1, %s) i", (ROWS,))
        conn.execute("INSERT INTO staged_jobs (task_name, args, queue, not_before) "
                     "SELECT 'later', jsonb_build_array(i), 'q', now() + i * interval '1 minute' "
                     "FROM generate_series(1, 10) i")
        conn.execute("VACUUM ANALYZE staged_jobs")


def test_the_listing_reads_the_head_in_the_drains_order_and_stops_there(db_url: str) -> None:
    _fill(db_url)
    with psycopg.connect(roles.url(db_url, roles.OPERATOR)) as conn:
        found, more = staged.listing(conn, staged.Filters(), 4)
        # Priority 1 first (odd i), in staging order; all of it read (fewer than SCAN).
        assert [json.loads(r["args"])[0] for r in found] == [1, 3, 5, 7] and not more
        found, more = staged.listing(conn, staged.Filters(task="t1", match='{"user": 3}'), 3)
        assert [json.loads(r["args"])[0] for r in found] == [13, 43, 73]
        found, _ = staged.listing(conn, staged.Filters(match="[40000]"), 5)
        assert [r["task_name"] for r in found] == ["t1"]
        # Beyond the head it reads, nothing is found, and it says it stopped there.
        found, more = staged.listing(conn, staged.Filters(match="[40000]"), 5, scan=1000)
        assert found == [] and more
        found, more = staged.listing(conn, staged.Filters(task="later"), 3)
        assert [json.loads(r["args"])[0] for r in found] == [1, 2, 3]  # by due time
        assert staged.listing(conn, staged.Filters(), 1, scan=1000)[1] is True
        # The plan: the drain's two indexes, each read for at most `scan` rows; no scan
        # of the whole table, whatever the filter.
        query, params = staged.listing_query(staged.Filters(tag="none", match='{"a": 1}'))
        [[explained]] = conn.execute(
            sql.SQL("EXPLAIN (FORMAT JSON) {}").format(query),
            {**params, "scan": 2000, "limit": 5}).fetchall()
    nodes = _nodes(explained[0]["Plan"])
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], explained
    assert "staged_jobs_ready_idx" in {n.get("Index Name") for n in nodes}, explained


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


def test_drain_staged_list_as_the_operator(db_url: str) -> None:
    _fill(db_url)
    ran = support.run_cli(db_url, "staged", "list", "--task", "t1", "--match", '{"user": 3}',
                          "--limit", "2", "--scan", "100")
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "2 job(s) shown, matching among the next 100 ready and 100 delayed jobs"
    assert "args=[13]" in lines[2] and "args=[43]" in lines[4]
    bad = support.run_cli(db_url, "staged", "list", "--match", "7")
    assert bad.returncode == 2 and "give a JSON array" in bad.stderr
