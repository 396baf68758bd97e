"""The fetch with a paused queue's pile staged: as cheap with 1,000,000 paused rows as with none.

    python bench/bench_paused.py [--paused 0,1000000] [--flowing 100000] [--smoke]

A queue the broker refuses (here: it exists with other arguments, so the
drain's declare gets 406) is paused, and its rows stay staged. For each pile
size, in a fresh database: the pile is staged into the refused queue (COPY,
then VACUUM ANALYZE), then ``--flowing`` jobs for a queue that works; a
drain runs in-process until every flowing job is published, and each fetch
is timed (``Drain(on_fetch=...)``: the fetch query and the look at the heads
that moves the marks). Reported per pile: the fetch time per full batch
(median, p90, p99, max) and how many fetches were slow (over 5 x the
no-pile median: those that follow a reset of the marks when the pause runs
out and the queue is tried again, see drain.postgres.keyset "Paused queues").

``--smoke`` (a 20,000-row pile, 5,000 flowing jobs) checks that the bench
works. Prints a table and writes bench/results/paused.json
(paused-smoke.json with ``--smoke``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import harness
import psycopg
from harness import BROKER_URL, broker_channel, staged_count

import drain
from drain.daemon.runner import Drain
from drain.settings.config import Settings

#: The goal: the median fetch with the pile within this factor of the one without.
GOAL_X = 1.5


def stage(url: str, n: int, queue: str, task: str) -> None:
    if n <= 0:
        return
    with psycopg.connect(url) as conn:
        drain.stage_many(conn, (drain.Job(task, [i], queue=queue) for i in range(n)))


def rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_pile(pile: int, flowing: int, batch: int) -> dict[str, Any]:
    fetches: list[tuple[float, int]] = []
    with harness.Setup("paused") as setup:
        url = setup.database()
        refused = setup.queue("refused", declare=False)
        with broker_channel() as channel:
            channel.queue_declare(refused, durable=True, arguments={"x-max-length": 1})
        working = setup.queue("flowing")
        stage(url, pile, refused, "bench.paused")
        stage(url, flowing, working, "bench.flowing")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE staged_jobs")
        runner = Drain(Settings(database_url=url, broker_url=BROKER_URL, batch_size=batch),
                       on_fetch=lambda seconds, rows: fetches.append((seconds, rows)))
        started = time.perf_counter()
        with harness.running(runner) as thread:
            def published() -> bool:
                if staged_count(url) <= pile:
                    return True
                if not thread.is_alive():
                    raise SystemExit(f"bench_paused: the drain stopped (pile {pile})")
                return False

            harness.wait_until(published, 600, f"bench_paused: the flowing jobs published "
                               f"(pile {pile})", interval=0.05)
            elapsed = time.perf_counter() - started
        left = staged_count(url)
    if left != pile:
        raise SystemExit(f"bench_paused: {left} rows left staged, expected the pile of {pile}")
    full = [seconds * 1000 for seconds, rows in fetches if rows >= batch]
    if not full:
        raise SystemExit("bench_paused: no full batch was fetched")
    return {"pile": pile, "flowing": flowing, "fetches": len(fetches), "full_batches": len(full),
            "median_ms": round(statistics.median(full), 2),
            "p90_ms": round(rank(full, 0.90), 2), "p99_ms": round(rank(full, 0.99), 2),
            "max_ms": round(max(full), 2), "seconds": round(elapsed, 2),
            "all_ms": [round(ms, 2) for ms in full]}


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--paused", default="0,1000000",
                        help="pile sizes, comma-separated (default 0,1000000)")
    parser.add_argument("--flowing", type=int, default=100_000,
                        help="jobs for the working queue per pile (default 100000)")
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args()
    if args.smoke:
        args.paused, args.flowing = "0,20000", 5000
    piles = [int(p) for p in args.paused.split(",") if p]
    rows = [one_pile(p, args.flowing, args.batch_size) for p in piles]
    base = rows[0]
    print(f"\nfetch per full batch of {args.batch_size} with a paused queue's pile staged, "
          f"{args.flowing:,} flowing jobs, {os.cpu_count()} cores\n")
    print("| paused rows | full batches | median ms | p90 ms | p99 ms | max ms | slow (> 5 x) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        slow = sum(1 for ms in r["all_ms"] if ms > 5 * base["median_ms"])
        r["slow"] = slow
        print(f"| {r['pile']:,} | {r['full_batches']} | {r['median_ms']} | {r['p90_ms']} | "
              f"{r['p99_ms']} | {r['max_ms']} | {slow} |")
    summary = []
    for r in rows[1:]:
        ratio = r["median_ms"] / base["median_ms"]
        print(f"\n{r['pile']:,} paused rows: median fetch {ratio:.2f} x the one with "
              f"{base['pile']:,} (goal <= {GOAL_X})")
        summary.append(harness.row(
            f"fetch with {r['pile']:,} paused rows staged",
            f"median <= {GOAL_X} x with {base['pile']:,}",
            f"{ratio:.2f} x ({r['median_ms']} vs {base['median_ms']} ms per "
            f"batch; p99 {r['p99_ms']} vs {base['p99_ms']}; {r['slow']} slow)",
            ratio <= GOAL_X))
    for r in rows:
        del r["all_ms"]
    harness.write_results("paused", summary, {"rows": rows}, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
