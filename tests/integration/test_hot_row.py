"""One hot row must not make every batch republish (drain.postgres.conflicts; issue 24, item 5).

A staged row updated every 2 ms for about 10 s (pgbench, Postgres' C client)
conflicts with the DELETE of every batch that holds it. Meanwhile 50 unrelated
rows are staged in its queue and, later, rows in another queue. Before, each
conflict rolled the whole batch back and republished it, and every new batch
fetched the hot row again: the unrelated rows stayed staged while it was being
updated and were delivered up to 8 times. Now the conflict costs the hot row
only: the unrelated rows are delivered once (at most twice), while it is still
being updated, and the hot row's last version arrives after its last update.
Deliveries are counted by a real consumer of both queues.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

import drain
from tests import support
from tests.deliveries import Deliveries
from tests.integration.conftest import Running

#: Updates of the hot row: pgbench at RATE per second, UPDATES in all (about 10 s).
RATE = 500
UPDATES = 5000
#: Unrelated rows in the hot row's queue, and in another queue (staged during the updates).
UNRELATED = 50
LATER = 20


def _hot_version(db_url: str) -> int | None:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT (args->>1)::int FROM staged_jobs "
                           "WHERE task_name = 't.hot'").fetchone()
    return None if row is None else int(row[0])


def test_one_hot_row_costs_that_row_not_every_batch(
    db_url: str, queue: str, other_queue: str, tmp_path: Path,
    start_active_drain: Callable[..., Running],
) -> None:
    with Deliveries([queue, other_queue]).running() as deliveries:
        # The default backoff: before, consecutive conflicts backed the drain off up to 10 s.
        running = start_active_drain(db_url, max_backoff=10.0)
        with psycopg.connect(db_url) as conn:  # delayed: due from its first update on
            drain.stage(conn, "t.hot", ["hot", 0], queue=queue, countdown=3600)
        script = tmp_path / "hot.sql"
        script.write_text("UPDATE staged_jobs SET not_before = NULL, "
                          "args = jsonb_build_array('hot', (args->>1)::int + 1) "
                          "WHERE task_name = 't.hot';\n")
        updater = subprocess.Popen(
            [support.pgbench(), "-n", "-c", "1", "-R", str(RATE), "-t", str(UPDATES),
             "-f", str(script), db_url],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            support.wait_for(lambda: (_hot_version(db_url) or 0) > 0, 30, "the first update")
            with psycopg.connect(db_url) as conn:
                drain.stage_many(conn, [drain.Job("t.unrelated", [f"u{i}"], queue=queue)
                                        for i in range(UNRELATED)])
            staged_at = {f"u{i}": time.monotonic() for i in range(UNRELATED)}
            for i in range(LATER):  # another queue, staged while the hot row is updated
                time.sleep(0.2)  # the workload's pace
                with psycopg.connect(db_url) as conn:
                    drain.stage(conn, "t.later", [f"l{i}"], queue=other_queue)
                staged_at[f"l{i}"] = time.monotonic()
            output, _ = updater.communicate(timeout=120)
        finally:
            if updater.poll() is None:
                updater.kill()
                updater.wait()
        updates_ended = time.monotonic()
        assert updater.returncode == 0, output
        final = _hot_version(db_url)  # None: the drain caught a quiet moment and removed it
        with psycopg.connect(db_url) as conn:
            row = conn.execute("SELECT count(*) FROM staged_jobs "
                               "WHERE task_name <> 't.hot'").fetchone()
            assert row is not None
            stuck = int(row[0])
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the backlog")
        support.wait_for(lambda: all(deliveries.count(m) for m in staged_at), 30,
                         "every unrelated row")
    assert deliveries.error is None, deliveries.error
    counts = {m: deliveries.count(m) for m in staged_at}
    during = [m for m in staged_at if deliveries.seen[m][0][0] < updates_ended]
    hot = deliveries.seen.get("hot", [])
    metric = running.drain.metrics.registry.get_sample_value
    conflicted = metric("drain_conflicted_rows_total")
    print(f"\n[hot row] {UPDATES} updates in {RATE}/s; hot row published {len(hot)} times "
          f"(final version {final}, last delivered {hot[-1][1][1] if hot else None}); "
          f"unrelated rows: delivered at most {max(counts.values())} times, "
          f"{len(during)}/{len(staged_at)} first delivered, {len(staged_at) - stuck}/"
          f"{len(staged_at)} deleted while the hot row was updated; "
          f"{conflicted} conflicted, {metric('drain_unsettled_rows_total')} unsettled")
    assert conflicted, "the hot row never conflicted: nothing was tested"
    assert max(counts.values()) <= 2, counts
    assert stuck == 0, f"{stuck} unrelated rows were still staged when the updates ended"
    assert sorted(during) == sorted(staged_at), (
        f"rows waited for the hot row: {sorted(set(staged_at) - set(during))}")
    if final is not None:
        assert hot and hot[-1][1][1] == final, "the hot row's last version did not arrive"
