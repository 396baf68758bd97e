"""Piles of staged rows that stay (a refused queue's) do not grow each batch's cost.

Issue 36, item 3: the delete of the confirmed rows looks each one up by its key,
whatever sits staged below it.
"""

from __future__ import annotations

from typing import Any

import psycopg

from drain.postgres import sql
from drain.postgres.store import Store
from drain.settings.config import Settings
from tests import roles, support


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
    plan = row[0][0]["Plan"]
    assert plan["Actual Rows"] == 1000  # every confirmed row deleted
    read = [node for node in _nodes(plan) if node.get("Relation Name") == "staged_jobs"
            and node["Node Type"] != "ModifyTable"]
    # One index lookup per confirmed id: the pile's 20,000 key entries stay unread.
    assert read and all(n["Node Type"] in ("Index Scan", "Index Only Scan") for n in read)
    entries = sum(n["Actual Rows"] * n["Actual Loops"] + n.get("Rows Removed by Filter", 0)
                  for n in read)
    assert entries <= 1000, (entries, plan)
