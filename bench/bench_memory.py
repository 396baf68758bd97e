"""Memory: the drain's RSS while it drains a large backlog.

    python bench/bench_memory.py [--rows 1000000] [--batch-size 1000] [--consume] [--smoke]

Target: draining 1,000,000 rows, the drain's RSS stays flat (no growth per
row), under 150 MB.

Stages N rows in a fresh database (one ``INSERT ... SELECT FROM
generate_series``, small realistic args and kwargs; not timed), then runs a
real ``drain run --exit-when-empty`` as a subprocess into a fresh durable
queue, and every ~0.25 s samples

* the drain's VmRSS and VmHWM from ``/proc/<pid>/status``;
* how many rows it has drained: the queue's message count (a passive
  ``queue_declare`` on a connection of our own: the messages the broker took),
  plus what the optional consumer has taken off, and Postgres' ``n_tup_del``
  for ``staged_jobs`` (cheap; the statistics lag up to a second).

The exact peak is the child's ``ru_maxrss`` from ``wait4`` once it exits.
Reports RSS after the first 10,000 rows, at 25/50/75/100 % drained, the peak,
and the growth per 100,000 rows: the least-squares slope of RSS against rows
drained over the samples after the warm-up (the first 10 % of the rows).

The queue holds N persistent messages at the end. It is declared beforehand as
a lazy queue (``x-queue-mode: lazy``: messages go to disk, not the broker's
memory) and the drain runs with ``--queue-declare passive``; ``--plain-queue``
uses a plain durable queue that the drain declares itself, as by default
(RabbitMQ 3.10 then holds ~3.7 KB of memory per message here). The broker's
memory is checked first with ``rabbitmqctl status``; with ``--consume`` (or
automatically when the broker lacks room) a background thread consumes the
messages as they arrive. The queue and the database are always deleted.
Writes bench/results/memory.json. Never run by the tests, except ``--smoke``
(20,000 rows: checks that the bench works, the figures mean nothing; writes
bench/results/memory-smoke.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import harness
import pika
import psycopg
from harness import BROKER_URL, QueueCounter, declare_queue

from drain.settings.urls import broker_parameters

GOAL_PEAK_MB = 150.0
GOAL_GROWTH_MB = 1.0  # per 100,000 rows
WARMUP_FRACTION = 0.10
FIRST_ROWS = 10_000
INTERVAL = 0.25
#: The broker memory one queued message takes in a plain (not lazy) queue:
#: measured ~3.7 KB on RabbitMQ 3.10 here, rounded up.
BROKER_BYTES_PER_MESSAGE = 4000


# -- the broker -------------------------------------------------------------------


def broker_memory() -> dict[str, float] | None:
    """Total memory in use and the high watermark, in MB (None: rabbitmqctl unavailable)."""
    if shutil.which("rabbitmqctl") is None:
        return None
    try:
        out = subprocess.run(
            ["rabbitmqctl", "status", "--formatter", "json"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        status = json.loads(out)
        used = status["memory"]["total"]["rss"]
        limit = status["vm_memory_high_watermark_limit"]
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, TypeError):
        return None
    return {"used_mb": used / 1e6, "watermark_mb": limit / 1e6}


def declare_lazy_queue(queue: str) -> None:
    conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
    try:
        conn.channel().queue_declare(queue, durable=True,
                                     arguments={"x-queue-mode": "lazy"})
    finally:
        conn.close()


class Consumer(threading.Thread):
    """Takes the messages off the queue as they arrive (no_ack), so the broker holds few."""

    def __init__(self, queue: str) -> None:
        super().__init__(daemon=True)
        self.queue = queue
        self.consumed = 0
        self.error: str | None = None
        self._stop = threading.Event()

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
            channel = conn.channel()
            channel.basic_qos(prefetch_count=2000)

            def on_message(_ch: Any, _method: Any, _props: Any, _body: bytes) -> None:
                self.consumed += 1

            channel.basic_consume(self.queue, on_message, auto_ack=True)
            while not self._stop.is_set():
                conn.process_data_events(time_limit=0.2)
            conn.close()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self._stop.set()
        self.join(10)


# -- the drain process --------------------------------------------------------------


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of ``pid`` in MB (empty once it is gone)."""
    found: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def deleted_rows(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT n_tup_del FROM pg_stat_user_tables WHERE relname = 'staged_jobs'"
    ).fetchone()
    return int(row[0]) if row else 0


def stage(url: str, n: int, queue: str) -> float:
    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, args, kwargs, queue) "
            "SELECT 'search.index_annotation', jsonb_build_array(g, 'user' || (g %% 997)), "
            "jsonb_build_object('annotation_id', g, 'force', g %% 2 = 0, "
            "'source', 'bench.memory', "
            "'requested_by', 'acct:user' || (g %% 97) || '@example.com'), "
            "%s FROM generate_series(1, %s) g",
            (queue, n),
        )
        conn.execute("ANALYZE staged_jobs")
    return time.perf_counter() - t0


@dataclasses.dataclass
class Run:
    """What one bench run was asked to do, and what it measured."""

    rows: int
    batch_size: int
    lazy: bool
    consume: bool
    queue: str
    stage_seconds: float = 0.0
    seconds: float = 0.0
    exit_code: int | None = None
    maxrss_mb: float = 0.0
    published: int = 0
    deleted: int = 0
    samples: list[dict[str, float]] = dataclasses.field(default_factory=list)
    broker_before: dict[str, float] | None = None
    broker_after: dict[str, float] | None = None
    smoke: bool = False

    @property
    def complete(self) -> bool:
        return self.exit_code == 0 and self.deleted == self.rows


def run_drain(url: str, run: Run, consumer: Consumer | None, log_path: Path) -> None:
    """Run ``drain run --exit-when-empty`` and sample it until it exits."""
    counter = QueueCounter(run.queue)
    argv = [
        "run",
        "--database-url", url, "--broker-url", BROKER_URL,
        "--batch-size", str(run.batch_size), "--exit-when-empty",
        "--queue-declare", "passive" if run.lazy else "celery",
    ]

    def published() -> int:
        return counter.count() + (consumer.consumed if consumer else 0)

    with open(log_path, "wb") as log, psycopg.connect(url, autocommit=True) as pg:
        proc = harness.drain_process(*argv, log=log, metrics=not run.smoke)
        t0 = time.perf_counter()
        try:
            while True:
                pid, wstatus, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid == proc.pid:
                    run.exit_code = proc.returncode = os.waitstatus_to_exitcode(wstatus)
                    run.maxrss_mb = usage.ru_maxrss / 1024
                    break
                mem = proc_status(proc.pid)
                if mem:
                    run.samples.append({
                        "t": round(time.perf_counter() - t0, 3),
                        "rss_mb": round(mem.get("VmRSS", 0.0), 2),
                        "hwm_mb": round(mem.get("VmHWM", 0.0), 2),
                        "published": published(),
                        "deleted": deleted_rows(pg),
                    })
                time.sleep(INTERVAL)
        finally:
            harness.stop([proc], 15)
        run.seconds = time.perf_counter() - t0
        run.published = published()
        left = pg.execute("SELECT count(*) FROM staged_jobs").fetchone()
        run.deleted = run.rows - (int(left[0]) if left else 0)
    counter.close()


def measure(run: Run) -> None:
    """Fresh database and queue, stage, drain, and always clean up."""
    with harness.Setup("mem") as setup, tempfile.TemporaryDirectory(
            prefix="bench_memory_") as tmp:
        url = setup.database()
        run.queue = setup.queue(declare=False)
        if run.lazy:
            declare_lazy_queue(run.queue)
        else:
            declare_queue(run.queue)
        run.stage_seconds = stage(url, run.rows, run.queue)
        print(f"staged {run.rows:,} rows in {run.stage_seconds:.1f}s", file=sys.stderr)
        consumer = Consumer(run.queue) if run.consume else None
        if consumer is not None:
            consumer.start()
            setup.callback(consumer.stop)
        log_path = Path(tmp) / "drain.log"
        run_drain(url, run, consumer, log_path)
        run.broker_after = broker_memory()
        if not run.complete:
            tail = log_path.read_text(errors="replace")[-3000:]
            print(f"drain exited {run.exit_code} after deleting {run.deleted} of {run.rows} "
                  f"rows; its log ends:\n{tail}", file=sys.stderr)


# -- analysis -------------------------------------------------------------------------


def rss_at(samples: list[dict[str, float]], rows: float) -> dict[str, float] | None:
    """The first sample at which at least ``rows`` rows were drained."""
    return next((s for s in samples if s["published"] >= rows), None)


def growth_per_100k(samples: list[dict[str, float]], n: int) -> tuple[float | None, int]:
    """Least-squares slope of RSS (MB) against rows drained, per 100,000 rows, after warm-up."""
    warm = [s for s in samples if WARMUP_FRACTION * n <= s["published"] < n]
    if len(warm) < 3 or len({s["published"] for s in warm}) < 2:
        return None, len(warm)
    fit = statistics.linear_regression([s["published"] for s in warm],
                                       [s["rss_mb"] for s in warm])
    return fit.slope * 100_000, len(warm)


def report(run: Run, *, smoke: bool = False) -> int:
    samples = run.samples
    if not samples:
        print("no samples: the drain exited too quickly", file=sys.stderr)
        return 1
    n = run.rows
    rate = n / run.seconds
    growth, fitted = growth_per_100k(samples, n)
    peak = max(run.maxrss_mb, *(s["hwm_mb"] for s in samples))
    points: list[tuple[str, dict[str, float] | None]] = [
        (f"after the first {FIRST_ROWS:,} rows", rss_at(samples, FIRST_ROWS)),
        *((f"{p} % drained", rss_at(samples, n * p / 100)) for p in (25, 50, 75)),
        ("100 % drained (last sample)", samples[-1]),
    ]
    flat = growth is not None and growth < GOAL_GROWTH_MB
    met = run.complete and peak < GOAL_PEAK_MB and flat
    growth_text = "n/a" if growth is None else f"{growth:+.3f} MB per 100k rows"

    print(f"\nmemory: drain run --exit-when-empty over {n:,} rows (batch {run.batch_size}), "
          f"{run.seconds:.1f}s, {rate:,.0f} rows/s, {len(samples)} samples every {INTERVAL}s, "
          f"{'lazy' if run.lazy else 'plain'} queue{', consumer on' if run.consume else ''}\n")
    print("| point | rows drained | RSS (MB) |")
    print("|---|---:|---:|")
    for name, s in points:
        rows_text = "-" if s is None else f"{int(s['published']):,}"
        rss_text = "-" if s is None else f"{s['rss_mb']:.1f}"
        print(f"| {name} | {rows_text} | {rss_text} |")
    print(f"| peak (VmHWM / ru_maxrss) | | {peak:.1f} |")
    print(f"| growth after warm-up ({fitted} samples, least squares) | | {growth_text} |")
    print(f"\ngoal: peak < {GOAL_PEAK_MB:.0f} MB and flat (growth < {GOAL_GROWTH_MB:g} MB per "
          f"100k rows): {'MET' if met else 'NOT MET'} (peak {peak:.1f} MB, growth {growth_text})")
    if run.broker_after is not None and run.broker_before is not None:
        print(f"broker memory with the queue full: {run.broker_after['used_mb']:.0f} MB "
              f"(before: {run.broker_before['used_mb']:.0f} MB)")

    harness.write_results("memory", [harness.row(
        "memory",
        f"draining {n:,} rows, RSS flat (< {GOAL_GROWTH_MB:g} MB per 100k rows) "
        f"and peak < {GOAL_PEAK_MB:.0f} MB",
        f"peak {peak:.1f} MB over {n:,} rows; growth {growth_text}", met)], smoke=smoke,
        details={
            "rows": n, "batch_size": run.batch_size, "consumer": run.consume,
            "queue": "lazy, --queue-declare passive" if run.lazy
                     else "plain, declared by the drain",
            "exit_code": run.exit_code, "deleted": run.deleted, "published": run.published,
            "stage_seconds": round(run.stage_seconds, 2),
            "drain_seconds": round(run.seconds, 2), "rows_per_second": round(rate),
            "peak_mb": round(peak, 2), "maxrss_mb": round(run.maxrss_mb, 2),
            "growth_mb_per_100k": None if growth is None else round(growth, 4),
            "fit_samples": fitted, "warmup_rows": int(WARMUP_FRACTION * n),
            "points": {name: (None if s is None else {"rows": int(s["published"]),
                                                      "rss_mb": s["rss_mb"]})
                       for name, s in points},
            "broker_memory_before": run.broker_before,
            "broker_memory_after": run.broker_after,
            "samples": samples,
        })
    return 0 if run.complete else 1


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--rows", type=int,
                        default=int(os.environ.get("BENCH_ROWS", "1000000")))
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--plain-queue", action="store_true",
                        help="a plain durable queue the drain declares (default: a lazy "
                             "queue declared beforehand, --queue-declare passive)")
    parser.add_argument("--consume", action="store_true",
                        help="consume the messages in a background thread as they arrive")
    args = parser.parse_args()
    if args.smoke:
        args.rows = 20_000
    run = Run(rows=args.rows, batch_size=args.batch_size, lazy=not args.plain_queue,
              consume=args.consume, queue="", smoke=args.smoke)

    run.broker_before = before = broker_memory()
    need_mb = 100.0 if run.lazy else run.rows * BROKER_BYTES_PER_MESSAGE / 1e6
    if before is None:
        print("rabbitmqctl unavailable: cannot check the broker's memory", file=sys.stderr)
    else:
        print(f"broker: {before['used_mb']:.0f} MB used, watermark {before['watermark_mb']:.0f} MB;"
              f" {run.rows:,} messages need up to ~{need_mb:.0f} MB", file=sys.stderr)
        if before["watermark_mb"] - before["used_mb"] < 2 * need_mb and not run.consume:
            print("broker memory is short: consuming the messages as they arrive", file=sys.stderr)
            run.consume = True
    measure(run)
    return report(run, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
