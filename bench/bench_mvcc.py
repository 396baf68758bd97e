"""Long-transaction immunity: fetch time and backlog while a snapshot is held open.

    python bench/bench_mvcc.py [--hold 600] [--baseline 60] [--after 30] [--rate 1000]
                               [--strategies head,keyset] [--png PATH] [--docs-png] [--smoke]

For each fetch strategy ("head": the plain head-of-index fetch; "keyset": the
drain's default, see drain/postgres/keyset.py), in a fresh database with a fresh queue:

* ``--stagers`` processes (default 2, own sessions) together commit ``--rate``
  jobs/s with ``drain.stage()``, one job per transaction; when Python falls
  behind its schedule, the next transaction stages every job then due (at
  most ``--max-per-commit``, with ``drain.stage_many()``) so the rate holds;
  the output says how many rows per commit that took;
* an in-process drain (a thread) reports every fetch's wall time and every
  cycle's confirmed rows through its ``on_fetch`` / ``on_cycle`` hooks;
* the queue is purged every 2 s (nothing consumes it; RabbitMQ must not fill).

Phases: ``--baseline`` seconds as is; then ``--hold`` seconds (env
MVCC_SECONDS) during which another session sits idle in
``BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM staged_jobs``,
holding a snapshot like a forgotten analytics transaction, so vacuum can
remove none of the rows the drain deletes; then it rolls back and ``--after``
seconds follow. The baseline's first 5 s are left out of its statistics.

The backlog is computed from counters (jobs the stager committed minus jobs
the drain confirmed), never with ``count(*)``, which under the held snapshot
would itself walk every dead row. ``n_dead_tup`` is sampled every 5 s.

Target 3: with the snapshot held, the drain's fetch time per batch stays
within 2x its value without it (median of the hold's last minute against the
baseline's median) and the backlog stays below two batches throughout.

Writes bench/results/mvcc.json, a PNG (bench/results/mvcc.png; also
docs/mvcc.png with --docs-png) and prints a table. Never run by the tests,
except ``--smoke``: a few seconds per phase at 200 jobs/s, which checks that
the bench works (the figures mean nothing) and writes
bench/results/mvcc-smoke.json and mvcc-smoke.png (never docs/mvcc.png).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import Any

import harness
import pika
import psycopg
from harness import BROKER_URL, RESULTS, ROOT
from mvcc_report import (
    GOAL_HOLD,
    GOAL_RATIO,
    LONG_WRITER,
    Run,
    fmt,
    plot,
    print_expire,
    result_name,
    series,
    summarize,
    verdict,
    with_expire,
)

import drain
from drain.daemon.runner import Drain, State
from drain.settings.config import Settings
from drain.settings.urls import broker_parameters

TASK = "bench.mvcc"
STRATEGIES = ("head", "keyset")
BACKLOG_EVERY = 0.25
PURGE_EVERY = 2.0
DEAD_EVERY = 5.0
DOCS_PNG = os.path.join(ROOT, "docs", "mvcc.png")


# -- the stager (a separate process: it must not take the drain's GIL) -------------------


#: --mix: job i is staged with MIX[i % 3] (countdown, expires): ready; delayed
#: 0.2 s; delayed 1 s and expiring after 0.5 s (moved to dead_jobs, never sent).
MIX: list[tuple[float | None, float | None]] = [(None, None), (0.2, None), (1.0, 0.5)]
NO_MIX: tuple[float | None, float | None] = (None, None)


def stager(*, url: str, queue: str, rate: float, max_per_commit: int, go: Event, stop: Event,
           counters: Any, slot: int, mix: bool = False) -> None:
    """Commit ``rate`` jobs/s until ``stop``: ``counters[2 * slot]`` counts the jobs
    committed, ``counters[2 * slot + 1]`` the transactions.

    One job per transaction while on schedule; when behind, the next
    transaction takes every job then due, up to ``max_per_commit``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it through ``stop``
    with psycopg.connect(url) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        go.wait()
        start = time.monotonic()
        staged = 0
        commits = 0
        while not stop.is_set():
            elapsed = time.monotonic() - start
            due = int(elapsed * rate) + 1
            n = min(due - staged, max_per_commit)
            if n <= 0:
                time.sleep(max(0.0, (staged + 1) / rate - elapsed))
                continue
            with conn.transaction():
                if n == 1:
                    countdown, expires = MIX[staged % 3] if mix else NO_MIX
                    drain.stage(conn, TASK, args=[staged], queue=queue,
                                countdown=countdown, expires=expires)
                else:
                    timing = [MIX[(staged + i) % 3] if mix else NO_MIX for i in range(n)]
                    drain.stage_many(conn, [
                        drain.Job(TASK, [staged + i], queue=queue, countdown=countdown,
                                  expires=expires)
                        for i, (countdown, expires) in enumerate(timing)])
            staged += n
            commits += 1
            counters[2 * slot + 1] = commits
            counters[2 * slot] = staged


class Stagers:
    """``n`` stager processes sharing ``rate`` (several sessions, as applications have)."""

    def __init__(self, url: str, queue: str, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.go, self.stop = ctx.Event(), ctx.Event()
        self.n = args.stagers
        self.counters = ctx.Array("q", 2 * self.n, lock=False)
        self.procs = [
            ctx.Process(target=stager, name=f"mvcc-stager-{i}", kwargs={
                "url": url, "queue": queue, "rate": args.rate / self.n,
                "max_per_commit": args.max_per_commit, "go": self.go, "stop": self.stop,
                "counters": self.counters, "slot": i, "mix": args.mix})
            for i in range(self.n)
        ]

    def start(self) -> None:
        for proc in self.procs:
            proc.start()

    @property
    def committed(self) -> int:
        return sum(self.counters[2 * i] for i in range(self.n))

    @property
    def commits(self) -> int:
        return sum(self.counters[2 * i + 1] for i in range(self.n))

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5)


# -- one run ------------------------------------------------------------------------------


def make_drain(url: str, strategy: str, batch_size: int, *,
               on_fetch: Callable[[float, int], None],
               on_cycle: Callable[[int, int], None],
               on_expire: Callable[[float, int], None]) -> Drain:
    settings = Settings(database_url=url, broker_url=BROKER_URL, batch_size=batch_size,
                        fetch_strategy=strategy)
    return Drain(settings, on_fetch=on_fetch, on_cycle=on_cycle, on_expire=on_expire)


class Purger:
    """Purges one queue every few seconds on its own connection (reconnects if needed)."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.purged = 0
        self._conn: Any = None
        self._channel: Any = None

    def purge(self) -> None:
        try:
            if self._conn is None or not self._conn.is_open or not self._channel.is_open:
                self.close()
                self._conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
                self._channel = self._conn.channel()
            frame = self._channel.queue_purge(self.queue)
            self.purged += int(frame.method.message_count)
        except Exception as exc:
            print(f"  queue purge failed ({type(exc).__name__}: {exc}); retrying",
                  file=sys.stderr)
            self.close()

    def close(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


DEAD_SQL = """
SELECT coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0),
       pg_relation_size('staged_jobs_ready_idx'),
       (SELECT backend_xmin IS NOT NULL FROM pg_stat_activity WHERE pid = %s)
FROM pg_stat_user_tables s WHERE s.relname = 'staged_jobs'
"""

#: The keyset marks move only once every transaction with an xid that was running
#: a moment ago has ended (drain/postgres/keyset.py): xids are cluster-wide, so a long
#: writing transaction in any database holds them back. Noted to explain a run.
WRITER_SQL = """
SELECT extract(epoch FROM now() - xact_start)::float8, datname FROM pg_stat_activity
WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
ORDER BY xact_start LIMIT 1
"""


class Sampler:
    """The bench's main-thread loop: holds and releases the snapshot, samples, purges."""

    def __init__(self, run: Run, url: str, stagers: Stagers, confirmed: list[int],
                 purger: Purger) -> None:
        self.run = run
        self.stagers = stagers
        self.confirmed = confirmed
        self.purger = purger
        self.monitor = psycopg.connect(url, autocommit=True)
        self.holder = psycopg.connect(url, autocommit=True)
        self.t0 = time.monotonic()
        self._next_purge = self._next_dead = self._next_print = 0.0

    def close(self) -> None:
        for conn in (self.holder, self.monitor):
            with contextlib.suppress(Exception):
                conn.close()

    def tick(self, now: float) -> None:
        run = self.run
        if not run.hold_started and now >= run.baseline:
            # A forgotten analytics transaction: it read once and sits idle, holding
            # its snapshot (no transaction id: it wrote nothing).
            self.holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            self.holder.execute("SELECT count(*) FROM staged_jobs").fetchone()
            run.hold_started = time.monotonic() - self.t0
            self._say(now, "snapshot held open")
        if run.hold_started and not run.hold_ended and now >= run.baseline + run.hold:
            self.holder.execute("ROLLBACK")
            run.hold_ended = time.monotonic() - self.t0
            self._say(now, "snapshot released")
        done = self.confirmed[0]  # read before committed: the difference is never negative
        committed = self.stagers.committed
        run.backlog.append((now, committed, done))
        if now >= self._next_purge:
            self.purger.purge()
            self._next_purge = now + PURGE_EVERY
        writer = self.monitor.execute(WRITER_SQL).fetchone()
        if writer is not None:
            run.writers.append((now, float(writer[0]), str(writer[1])))
        if now >= self._next_dead:
            row = self.monitor.execute(DEAD_SQL, (self.holder.info.backend_pid,)).fetchone()
            if row is not None:
                run.dead.append((now, int(row[0]), int(row[1]), int(row[2]), bool(row[3])))
            self._next_dead = now + DEAD_EVERY
        if now >= self._next_print:
            self._next_print = now + 30
            recent = [s for t, s, _ in run.fetches[-500:] if t > now - 5]
            median = statistics.median(recent) * 1000 if recent else float("nan")
            dead = run.dead[-1][1] if run.dead else 0
            self._say(now, f"committed {committed:,}, confirmed {done:,}, backlog "
                           f"{committed - done:,}, fetch p50 {median:.2f} ms (last 5 s), "
                           f"dead tuples {dead:,}")

    def _say(self, now: float, text: str) -> None:
        print(f"  {self.run.strategy} {now:6.1f}s {text}", file=sys.stderr)


def run_strategy(strategy: str, args: argparse.Namespace) -> Run:
    run = Run(strategy, args.baseline, args.hold, args.after)
    clock = {"t0": time.monotonic()}
    confirmed = [0]

    def on_fetch(seconds: float, rows: int) -> None:
        run.fetches.append((time.monotonic() - clock["t0"], seconds, rows))

    def on_cycle(_attempted: int, done: int) -> None:
        confirmed[0] += done

    def on_expire(seconds: float, rows: int) -> None:
        run.expires.append((time.monotonic() - clock["t0"], seconds, rows))
        confirmed[0] += rows  # dead-lettered (--mix): gone from the backlog too

    with harness.Setup(f"mvcc_{strategy}") as setup:
        url, queue = setup.database(), setup.queue()
        stagers = Stagers(url, queue, args)
        purger = Purger(queue)
        setup.callback(purger.close)
        setup.callback(stagers.close)
        stagers.start()
        runner = make_drain(url, strategy, args.batch_size, on_fetch=on_fetch,
                            on_cycle=on_cycle, on_expire=on_expire)
        thread = setup.enter_context(harness.running(runner))
        harness.poll(lambda: runner.state is State.ACTIVE, 30, interval=0.05)
        if runner.state is not State.ACTIVE:
            raise RuntimeError(f"the drain did not become active: {runner.state}")
        sampler = Sampler(run, url, stagers, confirmed, purger)
        setup.callback(sampler.close)
        clock["t0"] = sampler.t0 = time.monotonic()
        stagers.go.set()
        end_at = args.baseline + args.hold + args.after
        while (now := time.monotonic() - sampler.t0) < end_at:
            sampler.tick(now)
            if not thread.is_alive():
                raise RuntimeError("the drain thread died")
            time.sleep(BACKLOG_EVERY)
        run.ended = time.monotonic() - sampler.t0
        run.committed, run.commits = stagers.committed, stagers.commits
        run.confirmed = confirmed[0]
    return run


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--hold", type=float,
                        default=float(os.environ.get("MVCC_SECONDS", GOAL_HOLD)),
                        help="seconds the snapshot is held open (env MVCC_SECONDS)")
    parser.add_argument("--baseline", type=float,
                        default=float(os.environ.get("MVCC_BASELINE", "60")))
    parser.add_argument("--after", type=float, default=float(os.environ.get("MVCC_AFTER", "30")),
                        help="seconds measured after the snapshot is released")
    parser.add_argument("--rate", type=float, default=float(os.environ.get("MVCC_RATE", "1000")),
                        help="jobs staged per second")
    parser.add_argument("--stagers", type=int, default=int(os.environ.get("MVCC_STAGERS", "2")),
                        help="stager processes (sessions) sharing the rate")
    parser.add_argument("--max-per-commit", type=int, default=10,
                        help="rows one stager transaction may take when behind schedule")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--mix", action="store_true",
                        help="stage a third of the jobs delayed 0.2 s and a third delayed 1 s "
                        "and expiring after 0.5 s (dead-lettered): the delayed fetch and the "
                        "expire query under the held snapshot too")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated, from: " + ", ".join(STRATEGIES))
    parser.add_argument("--png", default=str(RESULTS / "mvcc.png"))
    parser.add_argument("--docs-png", action="store_true", help=f"also write {DOCS_PNG}")
    args = parser.parse_args()
    if args.smoke:
        # The hold spans t = 5 s, where the dead tuples (and the holder's snapshot) are
        # sampled (every DEAD_EVERY seconds).
        args.baseline, args.hold, args.after, args.rate, args.stagers = 3.0, 3.0, 1.0, 200.0, 1
        args.docs_png = False
    if args.png == parser.get_default("png"):
        args.png = str(RESULTS / f"{result_name(args)}.png")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown or not strategies:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
    if min(args.baseline, args.hold, args.rate, args.stagers, args.max_per_commit) <= 0:
        parser.error("--baseline, --hold, --rate, --stagers and --max-per-commit must be positive")
    if args.after < 0:
        parser.error("--after must not be negative")

    runs: list[Run] = []
    for strategy in strategies:
        print(f"{strategy}: {args.baseline:g} s baseline, {args.hold:g} s with a snapshot held "
              f"open, {args.after:g} s after; {args.rate:g} jobs/s", file=sys.stderr)
        runs.append(run_strategy(strategy, args))

    results = {run.strategy: summarize(run, args.batch_size) for run in runs}
    hold = runs[0].hold_ended - runs[0].hold_started
    print(f"\nlong-transaction immunity: {args.rate:g} jobs/s staged, batch {args.batch_size}, "
          f"baseline {args.baseline:g} s, snapshot held {hold:.0f} s, {args.after:g} s after; "
          f"{os.cpu_count()} cores\n")
    print("| strategy | phase | fetches | rows/fetch | fetch p50 | p95 | max | backlog max |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    labels = {"baseline": "baseline", "hold": "snapshot held",
              "hold_last": "held, last minute", "after": "after release"}
    for name, r in results.items():
        for phase, label in labels.items():
            p = r["phases"][phase]
            print(f"| {name} | {label} | {p['fetches']:,} | {p['rows_per_fetch']} | "
                  f"{fmt(p['p50_ms'])} ms | {fmt(p['p95_ms'])} ms | {fmt(p['max_ms'], '.1f')} ms | "
                  f"{p['backlog_max']:,} |")
    print()
    for name, r in results.items():
        print(f"{name}: hold's last minute / baseline fetch p50 = {fmt(r['ratio_p50'])}x "
              f"(goal <= {GOAL_RATIO:g}x), p95 {r['ratio_p95']}x; backlog max "
              f"{r['backlog_max']:,} (goal < {r['backlog_limit']:,}); dead tuples up to "
              f"{r['dead_tuples_max']:,}; snapshot held: {r['snapshot_held']}")
        print_expire(r)
        print(f"  {args.stagers} stager(s): {r['committed']:,} jobs in {r['commits']:,} "
              f"transactions ({r['rows_per_commit']} rows per commit; 1 when on schedule), "
              f"{r['stager_rate']:,.0f} jobs/s achieved; drain confirmed {r['confirmed']:,}")
        if r["seconds_with_writer_over_2s"]:
            w = r["longest_writer"]
            print(f"  note: for ~{r['seconds_with_writer_over_2s']:.0f} s a writing transaction "
                  f"was open over {LONG_WRITER:g} s somewhere in the cluster (longest "
                  f"{w['seconds']:.0f} s, database {w['database']!r}, at {w['at_s']:.0f} s): "
                  "keyset marks wait for such transactions, so the run was not quiet")
    measured, met = verdict(results, hold)
    goal = (f"with a snapshot held open {GOAL_HOLD / 60:.0f} min at {args.rate:g} jobs/s, the "
            f"keyset fetch's median per batch stays within {GOAL_RATIO:g}x the baseline's, "
            "backlog below two batches")
    print(f"\n{'MEETS' if met else 'MISSES' if met is False else 'not conclusive'}: {goal}")

    pngs = [args.png] + ([DOCS_PNG] if args.docs_png else [])
    if plot(runs, args, pngs[:1]):
        for path in pngs[1:]:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            shutil.copyfile(pngs[0], path)
        print("wrote " + ", ".join(pngs))
    goal, measured = with_expire(args, goal, measured, results)
    harness.write_results(
        "mvcc-mix" if args.mix else "mvcc",
        [harness.row("3. Long-transaction immunity", goal, measured, met)], smoke=args.smoke,
        details={
            "rate": args.rate, "batch_size": args.batch_size, "baseline_s": args.baseline,
            "hold_s": round(hold, 1), "after_s": args.after,
            "stagers": args.stagers, "max_per_commit": args.max_per_commit, "cores": os.cpu_count(),
            "results": results,
            "series": {run.strategy: series(run) for run in runs},
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
