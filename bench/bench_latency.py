"""Latency: staging COMMIT -> broker confirm, at a steady 1,000, 200 and 50 jobs/s.

    python bench/bench_latency.py [--rates 1000,200,50] [--duration 20] [--warmup 2]
                                  [--stagers auto] [--plain] [--no-consumer]
                                  [--drain-args "--poll-interval 1.0"]
                                  [--wait-quiet SECONDS] [--smoke]

Target: at a steady rate of single-row staging transactions, the time from the
staging COMMIT to the broker's confirm of that job's message is p50 <= 5 ms and
p99 <= 50 ms. 200 jobs/s comes from one stager; at 50 jobs/s the drain is
mostly idle, armed between jobs, and its wake-up (drain.postgres.wakeup) decides the
latency.

Set-up: a fresh database migrated with ``drain.postgres.migration.migrate``, a fresh durable
queue, and the drain as a separate process (``drain run``, the thing measured),
started once and kept for all the rates, as in production. Stager processes
(``--stagers``; by default one per 500 jobs/s) commit one ``drain.stage()`` per
transaction on an open-loop schedule: job i is due at t0 + i/rate, and a stager
that falls behind catches up at once instead of silently lowering the offered
rate; the achieved rate and the schedule lag are reported. Each stager records
``time.time()`` right after its COMMIT returns, keyed by the job's task id. The
first ``--warmup`` seconds of each rate are discarded.

Two measurements, on this machine's one clock (``time.time()``, i.e.
CLOCK_REALTIME, read in different processes):

* **commit -> confirm** (the target), read inside the drain process: by
  default the drain runs as ``python bench/bench_latency.py --drain-probe run
  ...``, which is exactly ``drain run`` (``drain.cli.main.main``) with timestamping
  wrappers around a few methods: the broker's ``basic.ack`` callback, fetch,
  publish, the wait for confirms, the batch transaction and the idle wait.
  Each appends one tuple per call and everything is written to a JSON file at
  exit; the drain's logic is unchanged. "Confirm" is the moment the drain
  handles the ``basic.ack`` (the broker sent it earlier, by up to the time the
  drain takes to turn its I/O loop). The same records split each job's
  latency into commit -> fetched -> handed to pika -> confirmed -> row deleted,
  which the diagnosis below the figures uses. ``--plain`` runs the unmodified
  ``python -m drain run`` instead; then only the consumer figure exists.
* **commit -> delivery to a consumer**: a pika consumer in its own process
  (``basic_consume``, ``auto_ack``, so no prefetch limit) records
  ``time.time()`` when each message arrives and finds the job by its task id
  (the Celery v2 message's ``correlation_id`` / ``id`` header). This is the
  external view of the same path. It bounds the *routing* of the message, not
  the confirm: RabbitMQ confirms a persistent message to a durable queue only
  once the queue has written it (or a consumer has acked it), which can come
  after the delivery, and the drain sees the confirm only when it next turns
  its I/O loop. So both are printed. ``--no-consumer`` leaves the queue
  without a consumer (messages pile up and are written to disk), which shows
  the confirm on the disk path.

Every committed job must be confirmed (probe), delivered (consumer) and gone
from ``staged_jobs`` at the end; ``lost`` counts the jobs that were not.

``--wait-quiet SECONDS`` waits for other work on the machine to stop first.

Caveats: two shared cores run the stagers, the drain, Postgres, RabbitMQ and
the consumer, so scheduling delays land in both directions (a late commit
timestamp shortens a latency, a late delivery timestamp lengthens it); the
machine's CPU use during each window is printed. A job is visible to the drain
a moment before its COMMIT returns to the stager, so a latency can be slightly
negative. Runs are short: treat the tails as noisy.

Writes ``bench/results/latency.json``. Never run by the tests, except
``--smoke``: 200 jobs/s for 0.5 s + 2 s, which checks that the bench works (the
figures mean nothing; it fails if nothing was measured) and writes
``bench/results/latency-smoke.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cpu
import harness
from harness import BROKER_URL, staged_count
from latency_probe import drain_probe
from latency_report import (
    Phase,
    Schedule,
    StagedRecord,
    analyse,
    probe_loop,
    probe_timelines,
    report,
    summary_row,
)

TASK_NAME = "bench.latency"
#: --wait-quiet: the machine counts as quiet below this fraction of all cores busy.
QUIET_BUSY = 0.25


# -- the consumer and the stagers (child processes) ------------------------------------


def consumer_process(broker_url: str, queue: str, ready: Any, stop: Any, out: Any) -> None:
    """Record time.time() at each delivery, by task id; send {task_id: [t, ...]} at the end."""
    import pika

    from drain.settings.urls import broker_parameters

    got: dict[str, list[float]] = {}
    conn = pika.BlockingConnection(broker_parameters(broker_url))
    channel = conn.channel()

    def on_message(_ch: Any, _method: Any, properties: Any, _body: bytes) -> None:
        t = time.time()
        task_id = properties.correlation_id or (properties.headers or {}).get("id")
        got.setdefault(str(task_id), []).append(t)

    channel.basic_consume(queue, on_message, auto_ack=True)
    ready.set()
    while not stop.is_set():
        conn.process_data_events(time_limit=0.2)
    conn.process_data_events(time_limit=0.2)
    with contextlib.suppress(Exception):
        conn.close()
    out.send(got)
    out.close()


def stager_process(schedule: Schedule, index: int, out: Any) -> None:
    """Stage jobs index, index + stagers, ... at their due times, one per transaction.

    Sends [(task_id, seq, due, t_begin, t_committed)] at the end.
    """
    import psycopg

    import drain

    records: list[StagedRecord] = []
    with psycopg.connect(schedule.url) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        for seq in range(index, schedule.jobs, schedule.stagers):
            due = schedule.t0 + seq / schedule.rate
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            begin = time.time()
            task_id = drain.stage(conn, TASK_NAME, [schedule.phase, seq], queue=schedule.queue)
            conn.commit()
            records.append((str(task_id), seq, due, begin, time.time()))
    out.send(records)
    out.close()


# -- one rate, and the whole run ---------------------------------------------------------


def run_phase(schedule: Schedule, warmup: float, duration: float, drain_pid: int) -> Phase:
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for k in range(schedule.stagers):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=stager_process, args=(schedule, k, send), daemon=True)
        p.start()
        send.close()
        pipes.append(recv)
        procs.append(p)
    # CPU use over the measured window.
    window = (schedule.t0 + warmup, schedule.t0 + warmup + duration)
    time.sleep(max(0.0, window[0] - time.time()))
    cpu0, machine0 = cpu.process_seconds(drain_pid), cpu.machine_seconds()
    rss0 = cpu.rss_kib(drain_pid)
    time.sleep(max(0.0, window[1] - time.time()))
    cpu1, machine1 = cpu.process_seconds(drain_pid), cpu.machine_seconds()
    rss1 = cpu.rss_kib(drain_pid)
    records: list[StagedRecord] = []
    for recv, p in zip(pipes, procs, strict=True):
        records.extend(recv.recv())
        p.join(timeout=30)
    records.sort(key=lambda r: r[1])
    return Phase(schedule, warmup, duration, records, (cpu1 - cpu0) / duration,
                 cpu.busy_share(machine0, machine1), rss=(rss0, rss1))


def start_consumer(broker_url: str, queue: str, stop: Any) -> tuple[Any, Any]:
    """The consumer process, consuming, and the end of the pipe it reports on."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    consumer = ctx.Process(target=consumer_process,
                           args=(broker_url, queue, ready, stop, send), daemon=True)
    consumer.start()
    send.close()
    if not ready.wait(15):
        consumer.kill()
        raise SystemExit("the consumer did not start")
    return consumer, recv


@dataclasses.dataclass
class Outcome:
    phases: list[Phase]
    delivered: dict[str, list[float]] | None
    probe: dict[str, Any] | None
    left_staged: int


def one_rate(args: argparse.Namespace, rate: float, url: str, queue: str, *,
             drain_proc: subprocess.Popen[bytes], log_path: Path) -> Phase:
    """Stage at ``rate`` for the warm-up and the measured window; wait for the drain."""
    stagers = max(1, math.ceil(rate / 500)) if args.stagers == "auto" else int(args.stagers)
    before = cpu.wait_quiet(args.wait_quiet, QUIET_BUSY)
    print(f"{rate:g} jobs/s: {args.warmup:g}s warm-up + {args.duration:g}s measured, "
          f"{stagers} stager process(es)"
          + (f", machine {100 * before:.0f}% busy before" if before is not None else "")
          + "...", file=sys.stderr)
    schedule = Schedule(url, queue, rate, time.time() + 0.5 + 0.05 * stagers,
                        round(rate * (args.warmup + args.duration)), stagers)
    phase = run_phase(schedule, args.warmup, args.duration, drain_proc.pid)
    phase.busy_before = before
    if not harness.poll(lambda: drain_proc.poll() is not None or staged_count(url) == 0, 60) \
            or drain_proc.poll() is not None:
        print("  staged_jobs not empty 60 s after the last commit", file=sys.stderr)
    if drain_proc.poll() is not None:
        raise SystemExit(f"the drain exited ({drain_proc.returncode}):\n"
                         f"{log_path.read_text(errors='replace')}")
    time.sleep(1.0)
    return phase


def run(args: argparse.Namespace, rates: list[float], setup: harness.Setup) -> Outcome:
    url, queue = setup.database(), setup.queue()
    workdir = Path(tempfile.mkdtemp(prefix="bench_latency_"))
    if not args.keep_logs:
        setup.callback(shutil.rmtree, workdir, ignore_errors=True)
    probe_path, log_path = workdir / "probe.json", workdir / "drain.log"
    drain_argv = ["run", "--database-url", url, "--broker-url", BROKER_URL,
                  *shlex.split(args.drain_args)]
    command = () if args.plain else (sys.executable, os.path.abspath(__file__), "--drain-probe")
    stop = mp.get_context("fork").Event()
    outcome = Outcome([], None, None, -1)
    consumer: Any = None
    if not args.no_consumer:
        consumer, consumer_recv = start_consumer(BROKER_URL, queue, stop)
        setup.callback(stop_consumer, consumer, stop)
    with log_path.open("wb") as log_file:
        drain_proc = setup.process(harness.drain_process(
            *drain_argv, command=command, log=log_file, metrics=not args.smoke,
            env={**os.environ, "BENCH_LATENCY_PROBE": str(probe_path)}))
    harness.wait_until(lambda: drain_proc.poll() is not None
                       or "broker connected" in log_path.read_text(errors="replace"), 30,
                       "the drain logging 'broker connected'", interval=0.05)
    if drain_proc.poll() is not None:
        raise SystemExit(f"the drain exited:\n{log_path.read_text(errors='replace')}")
    print(f"drain: pid {drain_proc.pid}, {'drain' if args.plain else 'the probe'} ..."
          + (f", log {log_path}" if args.keep_logs else ""), file=sys.stderr)
    for rate in rates:
        outcome.phases.append(one_rate(args, rate, url, queue, drain_proc=drain_proc,
                                       log_path=log_path))
    outcome.left_staged = staged_count(url)
    drain_proc.send_signal(signal.SIGTERM)
    drain_proc.wait(timeout=30)
    if consumer is not None:
        time.sleep(0.5)
        stop.set()
        outcome.delivered = consumer_recv.recv()
        consumer.join(timeout=10)
    if not args.plain:
        outcome.probe = json.loads(probe_path.read_text())
    return outcome


def stop_consumer(consumer: Any, stop: Any) -> None:
    stop.set()
    if consumer.is_alive():
        consumer.join(timeout=5)
        if consumer.is_alive():
            consumer.kill()


def parse_args() -> argparse.Namespace:
    parser = harness.parser(__doc__)
    parser.add_argument("--rates", default=os.environ.get("BENCH_RATES", "1000,200,50"),
                        help="comma-separated jobs/s, run one after the other "
                        "(default 1000,200,50)")
    parser.add_argument("--duration", type=float,
                        default=float(os.environ.get("BENCH_DURATION", "20")),
                        help="measured seconds per rate, after the warm-up (default 20)")
    parser.add_argument("--warmup", type=float,
                        default=float(os.environ.get("BENCH_WARMUP", "2")),
                        help="seconds staged first and discarded (default 2)")
    parser.add_argument("--stagers", default="auto",
                        help="stager processes per rate; 'auto': one per 500 jobs/s")
    parser.add_argument("--plain", action="store_true",
                        help="run the unmodified `python -m drain run` (no commit -> confirm)")
    parser.add_argument("--no-consumer", action="store_true",
                        help="no consumer on the queue: messages pile up (disk path)")
    parser.add_argument("--drain-args", default="",
                        help="extra `drain run` flags, e.g. '--poll-interval 0.5'")
    parser.add_argument("--wait-quiet", type=float,
                        default=float(os.environ.get("BENCH_WAIT_QUIET", "0")),
                        help="before each rate, wait up to this many seconds for the machine "
                             f"to be under {100 * QUIET_BUSY:.0f}%% busy (default 0: no wait)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the drain's log and the probe's records (a temp directory)")
    parser.add_argument("--output", type=Path, default=None,
                        help="default bench/results/latency.json (latency-smoke.json with "
                        "--smoke)")
    args = parser.parse_args()
    if args.smoke:
        args.rates, args.duration, args.warmup, args.wait_quiet = "200", 2.0, 0.5, 0.0
    return args


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--drain-probe":
        return drain_probe(sys.argv[2:])
    args = parse_args()
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    with harness.Setup("latency") as setup:
        outcome = run(args, rates, setup)
    timelines = probe_timelines(outcome.probe) if outcome.probe is not None else None
    print(f"\nlatency: single-row staging transactions, {os.cpu_count()} cores, loopback "
          "Postgres and RabbitMQ, persistent messages, durable classic queue"
          + (", no consumer" if args.no_consumer else "")
          + (f", drain args {args.drain_args}" if args.drain_args else ""))
    results, summary = [], []
    for phase in outcome.phases:
        r = analyse(phase, outcome.delivered, timelines)
        if outcome.probe is not None:
            start = phase.schedule.t0 + phase.warmup
            r["drain_loop"] = probe_loop(outcome.probe, start, start + phase.duration)
        report(r, outcome.left_staged)
        row = summary_row(r)
        if row is not None:
            summary.append(row)
        results.append(r)
    harness.write_results("latency", summary, smoke=args.smoke, path=args.output, details={
        "config": {"rates": rates, "duration": args.duration, "warmup": args.warmup,
                   "plain": args.plain, "consumer": not args.no_consumer,
                   "drain_args": args.drain_args, "cores": os.cpu_count()},
        "rates": results,
        "left_staged_at_end": outcome.left_staged,
    })
    if args.smoke and len(summary) != len(outcome.phases):
        print("smoke: a rate measured no latency at all: the bench is broken", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
