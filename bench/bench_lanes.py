"""Scale-out lanes: drain throughput with 1, 2 and 4 lanes, and where the CPU went.

    python bench/bench_lanes.py [--jobs 200000] [--lanes-list 1,2,4] [--batch-size 1000]
                                [--no-raw] [--no-spread] [--wait-quiet SECONDS] [--smoke]

Target 5: throughput for 1, 2 and 4 lanes; say where it stops scaling and why.

For each lane count N, one after the other: a fresh database and a fresh
durable queue (declared here, as Celery declares it; deleted after the round),
``--jobs`` rows staged with COPY (``drain.stage_many``) and ANALYZEd (not
timed), then N processes ``python -m drain run --exit-when-empty --lanes N
--lane K`` (K = 0..N-1) started at once. The round is timed from the first
start until the last exit, Python start-up included; rate = jobs / seconds.
Then: every drain exited 0, staged_jobs and dead_jobs are empty, and the queue
holds exactly ``--jobs`` messages.

Where the CPU went, from /proc, in % of one core (this machine's cores x 100 %
is the cap): the drains (exact, from ``wait4``'s rusage, per process), the
broker (``beam.smp``: utime+stime), Postgres (utime+stime of every postgres
process plus the postmaster's cutime+cstime, so backends that exit during the
round still count; "this database" sums the backends whose title names the
round's database, as last sampled), the whole machine from /proc/stat (busy
and idle, iowait counted as idle), and "other" = machine busy - drains -
broker - Postgres (other benches, this script, the kernel's softirqs not
charged to a process). The machine's load just before each round (a short
baseline) is reported too: other work on a shared machine skews the figures.
After each round (unless ``--no-raw``), the broker's own ceiling for as many
publishers: N processes publish the same number of messages with raw pika
(pipelined confirms, window 1000 each, the drain's encoded properties), first
into one queue, as the lanes do (every job names the same queue), then, for
N > 1, into N queues: whether the broker, or one queue in it, is the limit.
And for N > 1 (unless ``--no-spread``) one more drain round with the jobs
spread round-robin over N queues (each declared here): the lanes without the
one queue they all share in the target's round.

Samples every ``--interval`` seconds (CPU and the queue's message count) are
kept in the details as a timeline.

The broker holds one round's messages at a time (~3.7 KB of broker memory
each in a plain queue: ~0.75 GB for 200,000); its memory is checked first.
Prints a table and writes bench/results/lanes.json. Never run by the tests,
except ``--smoke``: 3,000 jobs, 1 and 2 lanes, every kind of round, which
checks that the bench works (the figures mean nothing) and writes
bench/results/lanes-smoke.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import harness
import psycopg
from bench_memory import BROKER_BYTES_PER_MESSAGE, broker_memory
from bench_throughput import raw_pika
from cpu import CLK_TCK, Sampler, Snapshot, broker_pids, interval_cpu, ours_ticks, percent
from harness import BROKER_URL, ROOT, QueueCounter
from lanes_report import QUIET_BUSY, Round, print_table, reason, write

import drain
from drain.broker.outgoing import Message
from drain.celery import message
from drain.postgres.rows import StagedRow

GOAL_JOBS = 200_000
#: N drains on one host cannot share the metrics port: the bench turns it off (an env
#: variable, which a drain without metrics ignores).
DRAIN_ENV = {**os.environ, "DRAIN_METRICS_PORT": "0"}


# -- one round -----------------------------------------------------------------------------


def stage(url: str, n: int, queues: list[str]) -> float:
    t0 = time.perf_counter()
    with psycopg.connect(url) as conn:
        drain.stage_many(
            conn,
            (
                drain.Job("bench.index_annotation", [i], {"user": f"user{i % 97}"},
                          queue=queues[i % len(queues)])
                for i in range(n)
            ),
        )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE staged_jobs")
    return time.perf_counter() - t0


def drain_round(rnd: Round, url: str, database: str, queues: list[str], *, batch_size: int,
                interval: float, timeout: float, baseline: float, wait_quiet: float,
                logdir: Path) -> None:
    """Run ``rnd.lanes`` drains at once and sample them until all exit."""
    sampler = Sampler(database)
    give_up = time.perf_counter() + wait_quiet
    while baseline > 0:
        a = sampler.take()
        time.sleep(baseline)
        rnd.baseline = interval_cpu(a, sampler.take())
        if rnd.baseline["busy"] < QUIET_BUSY or time.perf_counter() >= give_up:
            break
    counter = QueueCounter(*queues)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    started: dict[int, float] = {}
    running: dict[int, int] = {}  # pid -> index in procs
    snapshots: list[Snapshot] = []
    try:
        snapshots.append(sampler.take())
        t0 = time.perf_counter()
        for lane in range(rnd.lanes):
            log = open(logdir / f"lanes{rnd.lanes}-lane{lane}.log", "wb")  # noqa: SIM115
            logs.append(log)
            p = harness.drain_process(
                "run", "--exit-when-empty", "--lanes", str(rnd.lanes), "--lane", str(lane),
                "--database-url", url, "--broker-url", BROKER_URL,
                "--batch-size", str(batch_size), log=log, env=DRAIN_ENV)
            procs.append(p)
            started[p.pid] = time.perf_counter()
            running[p.pid] = lane
        sampler.drain_pids = list(running)
        rnd.exit_codes = [-1] * rnd.lanes
        rnd.drain_cpu_seconds = [0.0] * rnd.lanes
        rnd.drain_wall_seconds = [0.0] * rnd.lanes
        # The drains' CPU from wait4 replaces their /proc figures once they exit.
        exited_ticks: dict[int, int] = {}
        next_sample = time.perf_counter() + interval
        while running:
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"the drains still ran after {timeout:.0f} s")
            for pid in list(running):
                got, wstatus, usage = os.wait4(pid, os.WNOHANG)
                if got == pid:
                    lane = running.pop(pid)
                    code = os.waitstatus_to_exitcode(wstatus)
                    procs[lane].returncode = code
                    rnd.exit_codes[lane] = code
                    used = usage.ru_utime + usage.ru_stime
                    rnd.drain_cpu_seconds[lane] = used
                    rnd.drain_wall_seconds[lane] = time.perf_counter() - started[pid]
                    exited_ticks[pid] = round(used * CLK_TCK)
            now = time.perf_counter()
            if now >= next_sample or not running:
                s = sampler.take()
                s.drains = {**s.drains, **exited_ticks}
                snapshots.append(s)
                try:
                    queued = counter.count()
                except Exception:  # the timeline only; the final count is checked below
                    queued = -1
                point = {"t": round(s.t - t0, 3), "queued": queued,
                         **interval_cpu(snapshots[-2], s)}
                rnd.timeline.append(point)
                if rnd.first_message_seconds is None and queued > 0:
                    rnd.first_message_seconds = point["t"]
                next_sample = now + interval
            time.sleep(0.01)
        rnd.seconds = snapshots[-1].t - t0
    finally:
        harness.stop(procs, 15)
        for log in logs:
            log.close()
        counter.close()

    first, last = snapshots[0], snapshots[-1]
    # The drains' CPU is exact (rusage); the machine's, broker's and Postgres' are from
    # the snapshots around the round (the first taken just before the first start).
    cpu = interval_cpu(first, last)
    seconds = last.t - first.t
    cpu["drains"] = round(100.0 * sum(rnd.drain_cpu_seconds) / seconds, 1)
    cpu["postgres_this_database"] = round(percent(ours_ticks(snapshots), seconds), 1)
    cpu["other"] = round(cpu["busy"] - cpu["drains"] - cpu["broker"] - cpu["postgres"], 1)
    rnd.cpu = cpu
    rnd.per_drain = [round(100.0 * c / seconds, 1) for c in rnd.drain_cpu_seconds]


def verify(rnd: Round, url: str, queues: list[str]) -> None:
    counter = QueueCounter(*queues)
    try:
        rnd.queued = counter.count()
    finally:
        counter.close()
    with psycopg.connect(url) as conn:
        staged = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        dead = conn.execute("SELECT count(*) FROM dead_jobs").fetchone()
    rnd.staged_left = int(staged[0]) if staged else -1
    rnd.dead = int(dead[0]) if dead else -1


def measure(rnd: Round, *, batch_size: int, interval: float, timeout: float,
            baseline: float, wait_quiet: float) -> None:
    """Fresh database and queue(s), stage, drain in lanes, verify; always clean up."""
    with harness.Setup("lanes") as setup, tempfile.TemporaryDirectory(
            prefix="bench_lanes_") as tmp:
        url = setup.database()
        queues = [setup.queue(str(k)) for k in range(rnd.queues)]
        logdir = Path(tmp)
        rnd.stage_seconds = stage(url, rnd.jobs, queues)
        print(f"{rnd.label}: staged {rnd.jobs:,} rows in {rnd.stage_seconds:.1f} s, "
              "draining", file=sys.stderr)
        try:
            drain_round(rnd, url, url.rsplit("/", 1)[1], queues, batch_size=batch_size,
                        interval=interval, timeout=timeout, baseline=baseline,
                        wait_quiet=wait_quiet, logdir=logdir)
        except TimeoutError as exc:
            rnd.error = str(exc)
        verify(rnd, url, queues)
        if not rnd.ok:
            rnd.error = rnd.error or (
                f"exit codes {rnd.exit_codes}, {rnd.queued} queued of {rnd.jobs}, "
                f"{rnd.staged_left} left staged, {rnd.dead} dead")
            for log in sorted(logdir.glob("*.log")):
                print(f"--- {log.name} (end) ---\n"
                      f"{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)


# -- the broker's ceiling: N raw publishers at once ------------------------------------------


def raw_messages(n: int, queue: str, first_id: int) -> list[Message]:
    """The messages the drain would build for ``n`` rows staged as this bench stages them."""
    origin = message.origin()
    return [
        message.build(
            StagedRow(i, uuid.uuid4(), "bench.index_annotation", json.dumps([i]),
                              json.dumps({"user": f"user{i % 97}"}), queue),
            origin=origin, reply_to=str(uuid.uuid4()))
        for i in range(first_id, first_id + n)
    ]


def raw_publisher(queue: str, n: int, first_id: int) -> int:
    """The child side of ``raw_round``: build, say ready, wait for go, publish, report."""
    messages = raw_messages(n, queue, first_id)
    print("ready", flush=True)
    sys.stdin.readline()
    elapsed = raw_pika(messages, pre_encoded=True)
    t1 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    print(json.dumps({"t0": t1 - elapsed, "t1": t1}), flush=True)
    return 0


def wait_publishers(procs: list[subprocess.Popen[str]],
                    deadline: float) -> tuple[list[dict[str, float]], dict[int, int]]:
    """Wait for the raw publishers to exit: their reported spans, their CPU ticks."""
    spans, ticks = [], {}
    waiting = {p.pid: p for p in procs}
    while waiting:
        if time.perf_counter() > deadline:
            raise TimeoutError("the raw publishers ran past the timeout")
        for pid, p in list(waiting.items()):
            got, wstatus, usage = os.wait4(pid, os.WNOHANG)
            if got != pid:
                continue
            del waiting[pid]
            p.returncode = os.waitstatus_to_exitcode(wstatus)
            assert p.stdout is not None
            line = p.stdout.read()  # its one line, in the pipe already
            if p.returncode != 0 or not line.strip():
                raise RuntimeError(f"a raw publisher exited {p.returncode}")
            spans.append(json.loads(line))
            ticks[pid] = round((usage.ru_utime + usage.ru_stime) * CLK_TCK)
        time.sleep(0.01)
    return spans, ticks


def raw_round(rnd: Round, queues: list[str], timeout: float) -> dict[str, float]:
    """``rnd.lanes`` processes publish ``rnd.jobs`` messages in all, split evenly, each into
    ``queues[k % len(queues)]`` with raw pika (pipelined confirms, window 1000, the drain's
    encoded properties). The rate runs from the first publish to the last confirm; CPU
    from the go to the last exit."""
    n = rnd.lanes
    shares = [rnd.jobs // n + (1 if k < rnd.jobs % n else 0) for k in range(n)]
    procs: list[subprocess.Popen[str]] = []
    sampler = Sampler(database="-")
    try:
        for k in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--raw-publisher", queues[k % len(queues)],
                 str(shares[k]), str(1 + sum(shares[:k]))],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a raw publisher failed to start")
        sampler.drain_pids = [p.pid for p in procs]
        first = sampler.take()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        spans, ticks = wait_publishers(procs, first.t + timeout)
        last = sampler.take()
        last.drains = ticks
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
    seconds = max(x["t1"] for x in spans) - min(x["t0"] for x in spans)
    cpu = interval_cpu(first, last)
    return {"jobs_per_second": round(rnd.jobs / seconds), "seconds": round(seconds, 3),
            "publishers_cpu": cpu["drains"], "broker_cpu": cpu["broker"], "idle": cpu["idle"],
            "other": round(cpu["busy"] - cpu["drains"] - cpu["broker"], 1)}


def measure_raw(rnd: Round, timeout: float) -> None:
    """The broker's ceiling for this many publishers: into one queue (as the lanes publish:
    every job goes to the one queue its row names) and, for N > 1, into N queues."""
    variants = {"one queue": 1} if rnd.lanes == 1 else {"one queue": 1, "N queues": rnd.lanes}
    for name, count in variants.items():
        with harness.Setup("lanes_raw") as setup:
            queues = [setup.queue(str(k)) for k in range(count)]
            try:
                rnd.raw[name] = raw_round(rnd, queues, timeout)
            except (RuntimeError, TimeoutError) as exc:
                print(f"raw x{rnd.lanes} ({name}) failed: {exc}", file=sys.stderr)


def lane_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"expected lane counts like 1,2,4, got {text!r}")
    return counts


def main() -> int:
    if sys.argv[1:2] == ["--raw-publisher"]:
        return raw_publisher(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    parser = harness.parser(__doc__)
    parser.add_argument("--jobs", type=int,
                        default=int(os.environ.get("BENCH_JOBS", str(GOAL_JOBS))),
                        help=f"rows staged per round (env BENCH_JOBS, default {GOAL_JOBS:,})")
    parser.add_argument("--lanes-list", type=lane_counts, default=[1, 2, 4], metavar="N,N,...",
                        help="lane counts, one round each (default 1,2,4)")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=0.25,
                        help="seconds between CPU and queue samples (default 0.25)")
    parser.add_argument("--baseline", type=float, default=2.0,
                        help="seconds of machine load measured before each round (default 2)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help=f"before each round, wait up to this long for a baseline with "
                        f"the machine under {QUIET_BUSY:g} %% busy (default 0: do not wait)")
    parser.add_argument("--no-raw", action="store_true",
                        help="skip the broker's ceiling: N raw pika publishers at once, into "
                        "one queue and into N queues, after each lane count")
    parser.add_argument("--no-spread", action="store_true",
                        help="skip the extra round per lane count N > 1 with the jobs spread "
                        "over N queues")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="give up on a round after this many seconds (default 900)")
    args = parser.parse_args()
    if args.smoke:
        args.jobs, args.lanes_list, args.baseline, args.timeout = 3000, [1, 2], 0.2, 120.0

    broker_before = broker_memory()
    need_mb = args.jobs * BROKER_BYTES_PER_MESSAGE / 1e6
    if broker_before is None:
        print("rabbitmqctl unavailable: cannot check the broker's memory", file=sys.stderr)
    elif broker_before["watermark_mb"] - broker_before["used_mb"] < 2 * need_mb:
        print(f"broker memory is short: {broker_before['used_mb']:.0f} MB used of "
              f"{broker_before['watermark_mb']:.0f} MB, a round needs ~{need_mb:.0f} MB; "
              "use fewer --jobs", file=sys.stderr)
        return 1
    if not broker_pids():
        print("no beam.smp process visible: broker CPU will read 0", file=sys.stderr)

    rounds = []
    for lanes in args.lanes_list:
        spread = [] if args.no_spread or lanes == 1 else [lanes]
        for queues in [1, *spread]:
            rnd = Round(lanes=lanes, jobs=args.jobs, queues=queues)
            rounds.append(rnd)
            measure(rnd, batch_size=args.batch_size, interval=args.interval,
                    timeout=args.timeout, baseline=args.baseline, wait_quiet=args.wait_quiet)
            if not rnd.ok:
                print(f"{rnd.label} FAILED: {rnd.error}", file=sys.stderr)
                continue
            print(f"{rnd.label}: {rnd.rate:,.0f} jobs/s in {rnd.seconds:.2f} s", file=sys.stderr)
            if queues == 1 and not args.no_raw:
                measure_raw(rnd, args.timeout)

    print_table(rounds, args.jobs)
    short, why = reason(rounds)
    print(f"\n{why}")
    write(rounds, args, short, why, broker_before)
    return 0 if all(r.ok for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
