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
import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import Any

import pika
import psycopg

import drain
from drain.daemon.runner import Drain, State
from drain.settings.config import Settings
from drain.settings.urls import broker_parameters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (
    BROKER_URL,
    declare_queue,
    delete_queue,
    drop_database,
    fresh_database,
)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DOCS_PNG = os.path.join(os.path.dirname(HERE), "docs", "mvcc.png")
TASK = "bench.mvcc"
STRATEGIES = ("head", "keyset")
#: The goal's figures: hold this long, stay within this factor of the baseline.
GOAL_HOLD = 600.0
GOAL_RATIO = 2.0
#: The hold's last this many seconds are compared with the baseline.
LAST_WINDOW = 60.0
#: The baseline's first seconds (connections warming up) are not in its statistics.
WARMUP = 5.0
#: An open writing transaction older than this is reported (it holds keyset marks back).
LONG_WRITER = 2.0
BACKLOG_EVERY = 0.25
PURGE_EVERY = 2.0
DEAD_EVERY = 5.0
COLORS = {"head": "tab:red", "keyset": "tab:blue"}


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


@dataclasses.dataclass
class Run:
    """What one strategy's run recorded; times are seconds since the stager started."""

    strategy: str
    baseline: float
    hold: float
    after: float
    #: (t, fetch seconds, rows) per fetch, appended by the drain thread.
    fetches: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)
    #: (t, expire query seconds, rows moved) per expire query (drain thread).
    expires: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)
    #: (t, jobs committed, jobs confirmed)
    backlog: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)
    #: (t, n_dead_tup, n_live_tup, ready index bytes, holder holds a snapshot)
    dead: list[tuple[float, int, int, int, bool]] = dataclasses.field(default_factory=list)
    #: (t, seconds, database) of the oldest open transaction with a transaction id
    #: anywhere in the cluster (the drain's and stagers' own included; they are short)
    writers: list[tuple[float, float, str]] = dataclasses.field(default_factory=list)
    commits: int = 0
    committed: int = 0
    confirmed: int = 0
    hold_started: float = 0.0
    hold_ended: float = 0.0
    ended: float = 0.0


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
    tag = uuid.uuid4().hex[:8]
    db, queue = f"drain_bench_mvcc_{tag}", f"bench_mvcc_{strategy}_{tag}"
    run = Run(strategy, args.baseline, args.hold, args.after)
    url = fresh_database(db)
    declare_queue(queue)
    stagers = Stagers(url, queue, args)
    purger = Purger(queue)
    runner: Drain | None = None
    thread: threading.Thread | None = None
    sampler: Sampler | None = None
    clock = {"t0": time.monotonic()}
    confirmed = [0]

    def on_fetch(seconds: float, rows: int) -> None:
        run.fetches.append((time.monotonic() - clock["t0"], seconds, rows))

    def on_cycle(_attempted: int, done: int) -> None:
        confirmed[0] += done

    def on_expire(seconds: float, rows: int) -> None:
        run.expires.append((time.monotonic() - clock["t0"], seconds, rows))
        confirmed[0] += rows  # dead-lettered (--mix): gone from the backlog too

    try:
        stagers.start()
        runner = make_drain(url, strategy, args.batch_size, on_fetch=on_fetch,
                            on_cycle=on_cycle, on_expire=on_expire)
        thread = threading.Thread(target=runner.run, name=f"drain-{strategy}", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while runner.state is not State.ACTIVE and time.monotonic() < deadline:
            time.sleep(0.05)
        if runner.state is not State.ACTIVE:
            raise RuntimeError(f"the drain did not become active: {runner.state}")
        sampler = Sampler(run, url, stagers, confirmed, purger)
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
    finally:
        stagers.close()
        if sampler is not None:
            sampler.close()
        if runner is not None and thread is not None:
            runner.stop()
            thread.join(30)
            if thread.is_alive():
                print("  the drain did not stop within 30 s; dropping its database anyway",
                      file=sys.stderr)
        purger.close()
        with contextlib.suppress(Exception):
            delete_queue(queue)
        drop_database(db)
    return run


# -- figures ------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def fetch_stats(run: Run, lo: float, hi: float, *, expires: bool = False) -> dict[str, Any]:
    window = [(s, n) for t, s, n in (run.expires if expires else run.fetches) if lo <= t < hi]
    ms = [s * 1000 for s, _ in window]
    rows = [n for _, n in window if n]
    return {
        "from_s": round(lo, 1), "to_s": round(hi, 1), "fetches": len(ms),
        "p50_ms": pct(ms, 0.5), "p95_ms": pct(ms, 0.95),
        "max_ms": round(max(ms), 3) if ms else None,
        "rows_per_fetch": round(statistics.mean(rows), 1) if rows else 0,
    }


def backlog_max(run: Run, lo: float, hi: float) -> int:
    return max((c - d for t, c, d in run.backlog if lo <= t < hi), default=0)


def summarize(run: Run, batch_size: int) -> dict[str, Any]:
    h0, h1, end = run.hold_started, run.hold_ended, run.ended
    window = min(LAST_WINDOW, h1 - h0)
    bounds = {"baseline": (min(WARMUP, h0 / 2), h0), "hold": (h0, h1),
              "hold_last": (h1 - window, h1), "after": (h1, end)}
    phases = {}
    for name, (lo, hi) in bounds.items():
        phases[name] = fetch_stats(run, lo, hi)
        phases[name]["backlog_max"] = backlog_max(run, lo, hi)
    ratio_p50 = ratio(phases["hold_last"]["p50_ms"], phases["baseline"]["p50_ms"])
    expire_phases = {name: fetch_stats(run, lo, hi, expires=True)
                     for name, (lo, hi) in bounds.items()}
    worst = backlog_max(run, 0.0, end)
    held = [snap for t, *_, snap in run.dead if h0 < t < h1]
    dead_max = max((d for _, d, *_ in run.dead), default=0)
    index_max = max((size for _, _, _, size, _ in run.dead), default=0)
    oldest = max(run.writers, key=lambda w: w[1], default=(0.0, 0.0, ""))
    stalled = sum(BACKLOG_EVERY for _, age, _ in run.writers if age > LONG_WRITER)
    return {
        "strategy": run.strategy,
        "phases": phases,
        "ratio_p50": ratio_p50,
        "expire": expire_phases,
        "expire_ratio_p50": ratio(expire_phases["hold_last"]["p50_ms"],
                                  expire_phases["baseline"]["p50_ms"]),
        "ratio_p95": ratio(phases["hold_last"]["p95_ms"], phases["baseline"]["p95_ms"]),
        "backlog_max": worst,
        "backlog_limit": 2 * batch_size,
        "dead_tuples_max": dead_max,
        "ready_index_mb_max": round(index_max / 2**20, 1),
        "longest_writer": {"seconds": round(oldest[1], 1), "database": oldest[2],
                           "at_s": round(oldest[0], 1)},
        "seconds_with_writer_over_2s": round(stalled, 1),
        "snapshot_held": bool(held) and all(held),
        "committed": run.committed,
        "confirmed": run.confirmed,
        "stager_rate": round(run.committed / end, 1) if end else 0.0,
        "commits": run.commits,
        "rows_per_commit": round(run.committed / run.commits, 2) if run.commits else None,
        "within_ratio": ratio_p50 is not None and ratio_p50 <= GOAL_RATIO,
        "within_backlog": worst < 2 * batch_size,
    }


def series(run: Run, bin_seconds: float = 2.0) -> dict[str, Any]:
    """Compact time series for the JSON (per-bin fetch medians, sampled backlog)."""
    bins: dict[int, list[float]] = {}
    for t, s, _ in run.fetches:
        if t >= 0:
            bins.setdefault(int(t // bin_seconds), []).append(s * 1000)
    step = max(1, round(1.0 / BACKLOG_EVERY))
    return {
        "fetch_p50_ms": [[round(k * bin_seconds, 1), round(statistics.median(v), 3)]
                         for k, v in sorted(bins.items())],
        "backlog": [[round(t, 2), c - d] for t, c, d in run.backlog[::step]],
        "dead_tuples": [[round(t, 1), d] for t, d, *_ in run.dead],
    }


def rolling_median(points: list[tuple[float, float]], bin_seconds: float
                   ) -> tuple[list[float], list[float]]:
    bins: dict[int, list[float]] = {}
    for t, v in points:
        bins.setdefault(int(t // bin_seconds), []).append(v)
    keys = sorted(bins)
    return [(k + 0.5) * bin_seconds for k in keys], [statistics.median(bins[k]) for k in keys]


def plot(runs: list[Run], args: argparse.Namespace, paths: list[str]) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_fetch, ax_backlog) = plt.subplots(2, 1, sharex=True, figsize=(11, 7.5),
                                               height_ratios=(3, 2))
    ax_dead = ax_fetch.twinx()
    first = runs[0]
    span = max(run.ended for run in runs)
    bin_seconds = max(1.0, span / 300)
    for ax in (ax_fetch, ax_backlog):
        ax.axvspan(first.hold_started, first.hold_ended, color="0.85", zorder=0,
                   label="snapshot held open" if ax is ax_fetch else None)
    for run in runs:
        color = COLORS.get(run.strategy, "tab:green")
        points = [(t, s * 1000) for t, s, _ in run.fetches if t >= 0]
        stride = max(1, len(points) // 20000)
        sample = points[::stride]
        ax_fetch.scatter([t for t, _ in sample], [v for _, v in sample], s=2, alpha=0.12,
                         color=color, linewidths=0, rasterized=True)
        xs, ys = rolling_median(points, bin_seconds)
        ax_fetch.plot(xs, ys, color=color, linewidth=1.8,
                      label=f"{run.strategy}: fetch per batch (median per {bin_seconds:.1f} s)")
        ax_dead.plot([t for t, *_ in run.dead], [d for _, d, *_ in run.dead], color=color,
                     linestyle=":", linewidth=1.2, label=f"{run.strategy}: dead tuples")
        ax_backlog.plot([t for t, _, _ in run.backlog], [c - d for _, c, d in run.backlog],
                        color=color, linewidth=1.0, label=f"{run.strategy}: backlog")
    ax_backlog.axhline(2 * args.batch_size, color="black", linestyle="--", linewidth=1,
                       label=f"two batches ({2 * args.batch_size:,} jobs)")
    ax_fetch.set_yscale("log")
    ax_fetch.set_ylabel("fetch time per batch (ms, log)")
    ax_dead.set_ylabel("n_dead_tup (staged_jobs)")
    ax_dead.set_ylim(bottom=0)
    ax_backlog.set_ylabel("backlog (jobs committed - confirmed)")
    ax_backlog.set_ylim(bottom=0)
    ax_backlog.set_xlabel("seconds")
    handles, labels = ax_fetch.get_legend_handles_labels()
    more_handles, more_labels = ax_dead.get_legend_handles_labels()
    ax_fetch.legend(handles + more_handles, labels + more_labels, loc="upper left",
                    fontsize=8)
    ax_backlog.legend(loc="upper left", fontsize=8)
    held = first.hold_ended - first.hold_started
    ax_fetch.set_title(
        f"drain fetch under a long transaction: {args.rate:g} jobs/s staged, batch "
        f"{args.batch_size}, REPEATABLE READ snapshot held {held:.0f} s", fontsize=10)
    fig.tight_layout()
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def verdict(results: dict[str, dict[str, Any]], hold: float) -> tuple[str, bool | None]:
    keyset = results.get("keyset")
    parts = []
    for name, r in results.items():
        p = r["phases"]
        parts.append(
            f"{name}: fetch p50 {fmt(p['baseline']['p50_ms'])} ms -> "
            f"{fmt(p['hold_last']['p50_ms'])} ms in the hold's last minute "
            f"({fmt(r['ratio_p50'])}x), backlog max {r['backlog_max']:,}"
        )
    text = f"{hold:.0f} s hold; " + "; ".join(parts)
    if keyset is None:
        return text, None
    ok = keyset["within_ratio"] and keyset["within_backlog"] and keyset["snapshot_held"]
    if not ok:
        return text, False
    # The hold is measured between two sampler ticks: 599.9 s is a 10-minute hold.
    return text, True if hold >= GOAL_HOLD - 1.0 else None


def with_expire(args: argparse.Namespace, goal: str, measured: str,
                results: dict[str, Any]) -> tuple[str, str]:
    """With --mix, the summary row names the expire query's ratio too."""
    if not args.mix:
        return goal, measured
    return (goal + "; with delayed and expiring jobs (--mix), the expire query's too",
            measured + "; expire query " + ", ".join(
                f"{fmt(r['expire_ratio_p50'])}x" for r in results.values()))


def result_name(args: argparse.Namespace) -> str:
    """bench/results/<this>.json and .png: a smoke run and a --mix run keep their own."""
    return "mvcc-smoke" if args.smoke else "mvcc-mix" if args.mix else "mvcc"


def print_expire(r: dict[str, Any]) -> None:
    """The expire query's times, when it ran (with --mix it finds rows to move)."""
    e = r["expire"]
    if e["baseline"]["fetches"]:
        print(f"  expire query p50: baseline {fmt(e['baseline']['p50_ms'])} ms, hold's last "
              f"minute {fmt(e['hold_last']['p50_ms'])} ms ({fmt(r['expire_ratio_p50'])}x), "
              f"p95 {fmt(e['baseline']['p95_ms'])} -> {fmt(e['hold_last']['p95_ms'])} ms; "
              f"{e['hold_last']['fetches']} queries in the last minute")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--png", default=os.path.join(RESULTS, "mvcc.png"))
    parser.add_argument("--docs-png", action="store_true", help=f"also write {DOCS_PNG}")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run (checks the bench works; no figures)")
    args = parser.parse_args()
    if args.smoke:
        # The hold spans t = 5 s, where the dead tuples (and the holder's snapshot) are
        # sampled (every DEAD_EVERY seconds).
        args.baseline, args.hold, args.after, args.rate, args.stagers = 3.0, 3.0, 1.0, 200.0, 1
        args.docs_png = False
    if args.png == parser.get_default("png"):
        args.png = os.path.join(RESULTS, f"{result_name(args)}.png")
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
    os.makedirs(RESULTS, exist_ok=True)
    name = result_name(args)
    goal, measured = with_expire(args, goal, measured, results)
    out = {
        "name": name,
        "summary": [{"target": "3. Long-transaction immunity", "goal": goal,
                     "measured": measured, "met": None if args.smoke else met}],
        "details": {
            "rate": args.rate, "batch_size": args.batch_size, "baseline_s": args.baseline,
            "hold_s": round(hold, 1), "after_s": args.after,
            "stagers": args.stagers, "max_per_commit": args.max_per_commit, "cores": os.cpu_count(),
            "results": results,
            "series": {run.strategy: series(run) for run in runs},
        },
    }
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
