"""Starvation: how long one high-priority job waits behind a huge low-priority backfill.

    python bench/bench_priority.py [--backlog 1000000] [--samples 5] [--smoke]

Stages a backfill of N priority -10 rows (one INSERT ... SELECT), starts the
drain, and once it is busy publishing the backlog, commits one priority 10 job
at a time and measures the time from its COMMIT to the moment the drain
publishes its message, and to the moment its row is gone (confirmed by the
broker and deleted, which the drain does one cycle later: see drain.daemon.pipeline).
Prints each sample, the median
and maximum, and what the same job would wait in a first-in-first-out drain
(the backlog ahead of it divided by the measured rate); writes
bench/results/priority.json. Never run by the tests, except ``--smoke``: a
30,000-row backfill and two samples, which checks that the bench works (the
figures mean nothing) and writes bench/results/priority-smoke.json.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import harness
import psycopg
from harness import BROKER_URL

from drain.celery import message
from drain.daemon.runner import Drain
from drain.postgres.rows import StagedRow
from drain.settings.config import Settings


def staged(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(str(row[0])) if row else 0


def watch(runner: Drain) -> dict[int, float]:
    """When the drain builds (and at once sends) a message for a watched row, by row id."""
    published_at: dict[int, float] = {}
    build = runner.pipeline.builder.build

    def watching_build(row: StagedRow, now: float | None = None,
                       destination: message.Destination | None = None,
                       trace: dict[str, str] | None = None) -> Any:
        if row.priority > 0:
            published_at.setdefault(row.id, time.perf_counter())
        return build(row, now, destination, trace)

    runner.pipeline.builder.build = watching_build  # type: ignore[method-assign]
    return published_at


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--backlog", type=int,
                        default=int(os.environ.get("BENCH_BACKLOG", "1000000")))
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args()
    if args.smoke:
        args.backlog, args.samples = 30_000, 2
    with harness.Setup("prio") as setup, psycopg.connect(setup.database(),
                                                         autocommit=True) as conn:
        queue = setup.queue()
        t0 = time.perf_counter()
        conn.execute(
            "INSERT INTO staged_jobs (task_name, args, priority, tag, queue) "
            "SELECT 'bench.index_annotation', jsonb_build_array(g), -10, "
            "'backfill.bench', %s FROM generate_series(1, %s) g",
            (queue, args.backlog),
        )
        conn.execute("ANALYZE staged_jobs")
        print(f"staged a backfill of {args.backlog} priority -10 rows in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
        runner = Drain(Settings(database_url=setup.database_url, broker_url=BROKER_URL,
                                batch_size=args.batch_size))
        published_at = watch(runner)
        setup.enter_context(harness.running(runner, join=60))
        # Let the drain get going on the backlog first.
        while staged(conn) > args.backlog - 20 * args.batch_size:
            time.sleep(0.05)
        waits: list[float] = []
        to_publish: list[float] = []
        ahead: list[int] = []
        rate_t0, rate_n0 = time.perf_counter(), runner.published
        for _ in range(args.samples):
            with conn.transaction():
                row = conn.execute(
                    "INSERT INTO staged_jobs (task_name, args, priority, tag, queue) "
                    "VALUES ('bench.urgent', '[1]', 10, 'api.urgent', %s) RETURNING id",
                    (queue,),
                ).fetchone()
            assert row is not None
            row_id = int(str(row[0]))
            committed = time.perf_counter()
            while conn.execute("SELECT 1 FROM staged_jobs WHERE id = %s",
                               (row_id,)).fetchone():
                time.sleep(0.001)
            waits.append(time.perf_counter() - committed)
            to_publish.append(published_at[row_id] - committed)
            ahead.append(staged(conn))
            time.sleep(0.5)  # spread the samples over the run (not synchronisation)
        rate = (runner.published - rate_n0) / (time.perf_counter() - rate_t0)

    cycle = args.batch_size / rate
    print(f"\nstarvation: one priority 10 job behind a {args.backlog:,}-row priority -10 "
          f"backfill (batch {args.batch_size}, drain at {rate:,.0f} msg/s, one batch cycle "
          f"= {cycle * 1000:.0f} ms)\n")
    print("| sample | backlog behind it | commit -> published | commit -> confirmed, deleted "
          "| FIFO wait |")
    print("|---|---|---|---|---|")
    for i, (pub, wait, before) in enumerate(zip(to_publish, waits, ahead, strict=True), 1):
        print(f"| {i} | {before:,} | {pub * 1000:.0f} ms ({pub / cycle:.1f} cycles) | "
              f"{wait * 1000:.0f} ms ({wait / cycle:.1f} cycles) | {before / rate:.0f} s |")
    print(f"\ncommit -> published: median {statistics.median(to_publish) * 1000:.0f} ms, "
          f"max {max(to_publish) * 1000:.0f} ms; commit -> deleted: median "
          f"{statistics.median(waits) * 1000:.0f} ms, max {max(waits) * 1000:.0f} ms")
    harness.write_results("priority", [harness.row(
        "starvation: priority 10 behind a priority -10 backfill",
        "published ahead of the backfill, not after a FIFO wait",
        f"commit -> published median {statistics.median(to_publish) * 1000:.0f} ms behind "
        f"{args.backlog:,} rows" + (" (smoke: not a figure)" if args.smoke else ""),
        None)], smoke=args.smoke, details={
            "backlog": args.backlog, "batch_size": args.batch_size, "rate": round(rate),
            "to_publish_s": to_publish, "deleted_s": waits, "ahead": ahead})
    return 0


if __name__ == "__main__":
    sys.exit(main())
