"""Piles that stay staged (a refused queue's) against the other queues' rate (issue 36).

    python bench/bench_piles.py [--what held,delete,refused] [--pile 50000] [--good 20000]
                                [--queues 1000] [--seconds 20] [--rounds 1] [--smoke]

* ``held``: ``--pile`` rows for a queue whose declaration the broker refuses
  (406), then ``--good`` rows for a working queue; a drain runs in-process until
  every good row is published. Without ``--app`` the rows are staged with their
  queue; with it (bench/bench_app_piles.py) staged without one, and the app's
  task_routes send them to the refused queue or to the good one, so the drain
  holds the pile (drain.daemon.piles): by route with a plain mapping
  (``--app``), and with a router function that routes by task name (``--app
  fn``: the drain asks it with stand-ins for the arguments, drain.celery.stand_in).
  Reported per variant: the good rows' rate with the pile against without it
  (goal >= 0.8 x), the fetches, their mean time and the most ids one fetch left
  out.
* ``delete``: the delete of 1,000 confirmed rows above the pile (EXPLAIN
  ANALYZE on the drain's session): index entries read and its time.
* ``refused``: ``--queues`` queues the broker refuses, a row each, while a
  healthy queue gets a job every 20 ms for ``--seconds``: each healthy job's
  wait (staged -> deleted after its confirm), the refused declares issued and
  the warnings logged.

* ``queues``: ``--good`` rows over ``--spread`` distinct working queues against
  the same rows in one queue: the drain's rate (each queue declared once per
  connection; a batch starts declares for at most DECLARE_BUDGET, the rest wait
  for the next batches).

``--smoke`` runs tiny sizes. Prints a table and writes bench/results/piles.json
(piles-smoke.json with ``--smoke``).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
import uuid
from typing import Any

import harness
import psycopg
from harness import BROKER_URL, broker_channel, staged_count

import drain
from drain.broker import queue_declare
from drain.daemon.runner import Drain
from drain.postgres import sql
from drain.postgres import store as store_module
from drain.settings.config import Settings

#: The goal (issue 36, item 5): other queues' rate with a pile >= this x without.
GOAL = 0.8
TAG = uuid.uuid4().hex[:8]
HELD, GOOD = f"bench_piles_held_{TAG}", f"bench_piles_good_{TAG}"
os.environ["BENCH_PILES_HELD"], os.environ["BENCH_PILES_GOOD"] = HELD, GOOD

#: What the drain sent and did, counted by wrapping its methods (this process only).
COUNTS: dict[str, int] = {"excluded_max": 0, "refused_declares": 0}
_fetch = store_module.Store.fetch
_declare = queue_declare.QueueDeclaringLink.declare


def _counted_fetch(self: Any, limit: int, exclude: list[int] | None = None,
                   *args: Any, **options: Any) -> Any:
    COUNTS["excluded_max"] = max(COUNTS["excluded_max"], len(exclude or []))
    return _fetch(self, limit, exclude, *args, **options)


def _counted_declare(self: Any, queues: set[str], **options: Any) -> dict[str, str]:
    refused = _declare(self, queues, **options)
    COUNTS["refused_declares"] += len(refused)
    return refused


store_module.Store.fetch = _counted_fetch  # type: ignore[method-assign]
queue_declare.QueueDeclaringLink.declare = _counted_declare  # type: ignore[method-assign]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def stage(url: str, n: int, task: str, queue: str | None) -> None:
    if n > 0:
        with psycopg.connect(url) as conn:
            drain.stage_many(conn, (drain.Job(task, [i], queue=queue) for i in range(n)))


def refuse(*queues: str) -> None:
    """Declare ``queues`` with an argument the drain's declare does not give: 406."""
    with broker_channel() as channel:
        for queue in queues:
            channel.queue_declare(queue, durable=True, arguments={"x-max-length": 1})


def delete_queues(*queues: str) -> None:
    with broker_channel() as channel:
        for queue in queues:
            channel.queue_delete(queue)


def held_round(pile: int, good: int, app: str, batch: int) -> dict[str, Any]:
    fetches: list[float] = []
    with harness.Setup("piles") as setup:
        url = setup.database()
        refuse(HELD)
        setup.callback(delete_queues, HELD, GOOD)
        stage(url, pile, "bench.held", None if app else HELD)
        stage(url, good, "bench.good", None if app else GOOD)
        target = {"app": "bench_app_piles:app", "fn": "bench_app_piles:by_function"}
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE staged_jobs")
        settings = Settings(database_url=url, broker_url=BROKER_URL, batch_size=batch,
                            celery_app=target.get(app, ""))
        COUNTS["excluded_max"] = 0
        runner = Drain(settings, on_fetch=lambda seconds, rows: fetches.append(seconds))
        started = time.perf_counter()
        with harness.running(runner) as thread:
            def done() -> bool:
                if not thread.is_alive():
                    raise SystemExit("bench_piles: the drain stopped")
                return staged_count(url) <= pile
            harness.wait_until(done, 900, f"bench_piles: {good} good rows published",
                               interval=0.02)
            elapsed = time.perf_counter() - started
    return {"app": app, "pile": pile, "good": good, "seconds": round(elapsed, 3),
            "rate": round(good / elapsed), "fetches": len(fetches),
            "fetch_mean_ms": round(1000 * statistics.fmean(fetches), 2) if fetches else 0.0,
            "excluded_max": COUNTS["excluded_max"]}


def delete_cost(pile: int) -> dict[str, Any]:
    with harness.Setup("piles") as setup:
        url = setup.database()
        stage(url, pile, "bench.held", HELD)
        stage(url, 1000, "bench.good", GOOD)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE staged_jobs")
            rows = conn.execute("SELECT id, xact::text FROM staged_jobs WHERE queue = %s",
                                [GOOD]).fetchall()
        session = store_module.Store(Settings(database_url=url))
        session.connect()
        entries, times = 0, []
        try:
            conn = session._require()
            for _ in range(5):
                with conn.transaction(force_rollback=True):
                    out = conn.execute(
                        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.query("delete_confirmed"),
                        {"ids": [r[0] for r in rows], "xacts": [r[1] for r in rows]}).fetchone()
                assert out is not None
                explained: Any = out[0]
                plan = explained[0]
                times.append(float(plan["Execution Time"]))
                entries = sum(n["Actual Rows"] * n["Actual Loops"]
                              for n in _nodes(plan["Plan"])
                              if n.get("Relation Name") == "staged_jobs"
                              and n["Node Type"] != "ModifyTable")
        finally:
            session.close()
    return {"pile": pile, "entries_read": entries, "median_ms": round(statistics.median(times), 2)}


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found += _nodes(child)
    return found


def refused_round(queues: int, seconds: float) -> dict[str, Any]:
    names = [f"bench_piles_r{i}_{TAG}" for i in range(queues)]
    warnings = Warnings()
    logging.getLogger("drain").addHandler(warnings)
    waits: list[float] = []
    with harness.Setup("piles") as setup:
        url = setup.database()
        refuse(*names)
        setup.callback(delete_queues, *names, GOOD)
        with psycopg.connect(url) as conn:
            drain.stage_many(conn, (drain.Job("bench.held", [i], queue=q)
                                    for i, q in enumerate(names)))
        COUNTS["refused_declares"] = 0
        runner = Drain(Settings(database_url=url, broker_url=BROKER_URL))
        with harness.running(runner), psycopg.connect(url, autocommit=True) as conn:
            staged: dict[int, float] = {}
            end = time.monotonic() + seconds
            next_at = time.monotonic()
            while time.monotonic() < end or staged:
                now = time.monotonic()
                if now >= next_at and now < end:
                    row = conn.execute(
                        "INSERT INTO staged_jobs (task_name, args, queue) "
                        "VALUES ('bench.good', '[0]', %s) RETURNING id", [GOOD]).fetchone()
                    assert row is not None
                    staged[int(row[0])] = time.monotonic()
                    next_at += 0.02
                if staged:
                    left = {int(r[0]) for r in conn.execute(
                        "SELECT id FROM staged_jobs WHERE id = ANY(%s)", [list(staged)])}
                    now = time.monotonic()
                    for job_id in [i for i in staged if i not in left]:
                        waits.append(now - staged.pop(job_id))
                if time.monotonic() > end + 60:
                    raise SystemExit("bench_piles: healthy jobs not published within 60 s")
                time.sleep(0.002)
    logging.getLogger("drain").removeHandler(warnings)
    waits.sort()
    return {"queues": queues, "seconds": seconds, "healthy_jobs": len(waits),
            "wait_median_s": round(statistics.median(waits), 3),
            "wait_p99_s": round(harness.percentile(waits, 99), 3),
            "wait_max_s": round(waits[-1], 3),
            "refused_declares": COUNTS["refused_declares"], "warnings": warnings.count}


def spread_round(good: int, queues: int) -> dict[str, Any]:
    names = [f"bench_piles_s{i}_{TAG}" for i in range(queues)]
    with harness.Setup("piles") as setup:
        url = setup.database()
        setup.callback(delete_queues, *names)
        with psycopg.connect(url) as conn:
            drain.stage_many(conn, (drain.Job("bench.good", [i], queue=names[i % queues])
                                    for i in range(good)))
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE staged_jobs")
        runner = Drain(Settings(database_url=url, broker_url=BROKER_URL))
        started = time.perf_counter()
        with harness.running(runner):
            harness.wait_until(lambda: staged_count(url) == 0, 900,
                               f"bench_piles: {good} rows over {queues} queues", interval=0.02)
            elapsed = time.perf_counter() - started
    return {"queues": queues, "good": good, "seconds": round(elapsed, 3),
            "rate": round(good / elapsed)}


def main() -> int:
    parser = harness.parser(__doc__, rounds=1)
    parser.add_argument("--what", default="held,delete,refused")
    parser.add_argument("--pile", type=int, default=50_000)
    parser.add_argument("--good", type=int, default=20_000)
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--spread", type=int, default=2000,
                        help="distinct queues of the queues round (default 2000)")
    args = parser.parse_args()
    if args.smoke:
        args.pile, args.good, args.queues, args.seconds, args.spread = 3000, 2000, 20, 2.0, 50
    what = set(args.what.split(","))
    summary: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    print(f"\n{os.cpu_count()} cores; pile {args.pile:,}, good {args.good:,}\n")
    if "held" in what:
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for app in harness.turns(r, ["", "app", "fn"]):
                for pile in harness.turns(r, [0, args.pile]):
                    rounds.append(held_round(pile, args.good, app, args.batch_size))
                    print(rounds[-1])
        details["held"] = rounds
        print("\n| --app | pile | good rows/s | fetches | mean fetch ms | most ids left out |")
        print("|---|---:|---:|---:|---:|---:|")
        for x in rounds:
            print(f"| {x['app'] or 'no'} | {x['pile']:,} | {x['rate']:,} | "
                  f"{x['fetches']} | {x['fetch_mean_ms']} | {x['excluded_max']:,} |")
        for app in ("", "app", "fn"):
            rate = {p: statistics.median(x["rate"] for x in rounds
                                         if x["app"] == app and x["pile"] == p)
                    for p in (0, args.pile)}
            ratio = rate[args.pile] / rate[0]
            summary.append(harness.row(
                f"good rows' rate with {args.pile:,} held rows"
                f"{dict(app=' (--app)', fn=' (--app, router function)').get(app, '')}",
                f">= {GOAL} x without the pile",
                f"{ratio:.2f} x ({rate[args.pile]:,.0f} vs {rate[0]:,.0f} jobs/s)",
                ratio >= GOAL))
    if "delete" in what:
        costs = [delete_cost(p) for p in (0, args.pile)]
        details["delete"] = costs
        for c in costs:
            print(f"delete of 1,000 confirmed rows above {c['pile']:,}: "
                  f"{c['entries_read']:,} key entries, {c['median_ms']} ms")
        summary.append(harness.row(
            f"delete of 1,000 confirmed rows above {args.pile:,} staged", "reads 1,000 entries",
            f"{costs[1]['entries_read']:,} entries, {costs[1]['median_ms']} ms "
            f"(no pile: {costs[0]['median_ms']} ms)", costs[1]["entries_read"] <= 1000))
    if "refused" in what:
        refusals = refused_round(args.queues, args.seconds)
        details["refused"] = refusals
        print(refusals)
        summary.append(harness.row(
            f"healthy jobs' wait with {args.queues:,} refused queues",
            "median well under 0.1 s, one warning per cause",
            f"median {refusals['wait_median_s']} s, max {refusals['wait_max_s']} s; "
            f"{refusals['refused_declares']:,} refused declares, "
            f"{refusals['warnings']:,} warnings", refusals["wait_median_s"] < 0.1))
    if "queues" in what:
        spread = [spread_round(args.good, n) for n in (1, args.spread)]
        details["queues"] = spread
        ratio = spread[1]["rate"] / spread[0]["rate"]
        print(f"{args.good:,} rows over 1 / {args.spread:,} queues: "
              f"{spread[0]['rate']:,} / {spread[1]['rate']:,} jobs/s ({ratio:.2f} x)")
        summary.append(harness.row(
            f"{args.good:,} rows over {args.spread:,} queues", "measured (RabbitMQ's cost)",
            f"{ratio:.2f} x the one-queue rate ({spread[1]['rate']:,} vs "
            f"{spread[0]['rate']:,} jobs/s)", None))
    harness.write_results("piles", summary, details, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
